import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def model_dir():
    d = os.environ.get("INFERSCALE_SMOLLM2_HF", "")
    if not d or not os.path.isfile(os.path.join(d, "config.json")):
        pytest.fail("INFERSCALE_SMOLLM2_HF is not a model folder: run `bash .ci/vllm` and export "
                    "what it prints (the real model is required; this test does not skip)")
    return d
