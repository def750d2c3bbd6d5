"""The memory and questions the connector's tests and bench/vllm/fidelity_vllm.py share: a dozen
facts about one user, a chat-template system prefix, and questions each fact answers."""

SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. You know these facts about the "
          "user:\n")
FACTS = [
    "Caroline moved to Lisbon in March 2021 to work as a marine biologist.",
    "Caroline's sister Ana is a pediatric nurse who lives in Porto.",
    "Caroline adopted a grey cat named Pixel from a shelter last winter.",
    "Caroline is training for the Lisbon half marathon in October.",
    "Caroline's favourite book is 'The Sea Around Us' by Rachel Carson.",
    "Caroline plays the cello in a community orchestra on Thursdays.",
    "Caroline is allergic to peanuts and avoids Thai restaurants.",
    "Caroline's best friend Melanie paints watercolour landscapes.",
    "Caroline studied oceanography at the University of Southampton.",
    "Caroline bought a second-hand sailing boat called Maré in 2023.",
    "Caroline volunteers at a beach clean-up every first Saturday of the month.",
    "Caroline's father Jorge runs a small bakery in Coimbra.",
]
QUESTIONS = [
    "Where does Caroline live and what is her job?",
    "What is the name of Caroline's cat?",
    "Which race is Caroline training for?",
    "What instrument does Caroline play?",
    "What food is Caroline allergic to?",
    "Who is Melanie?",
    "Where did Caroline study?",
    "What does Caroline's father do?",
]
GEN = 32


def query_tokens(tok, q):
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)


SPARE_PAGES = 32  # room in the store for facts a test adds later


def joint_memory(llm, directory, users, **store_args):
    """A Memory in `directory` (Memory.create's keyword arguments in `store_args`; by default as
    many pages as the facts fill, plus SPARE_PAGES: every reader loads the whole pool at each
    generation, so it is kept small) whose prefix is SYSTEM and in which each of `users` holds the
    whole fact list encoded jointly: one forward of prefix + facts through `llm`, captured
    pre-RoPE (Theorem 3's case). The caller holds the writer. Returns (mem, tok, {user: fact id},
    the capture's {"k", "v"})."""
    from inferscale_vllm.encode import capture, model_description
    from inferscale_vllm.memory import Memory

    tok = llm.get_tokenizer()
    prefix = tok.encode(SYSTEM, add_special_tokens=False)
    text = "".join(f"- {f}\n" for f in FACTS)
    ids = tok.encode(text, add_special_tokens=False)
    page = store_args.get("page_size", 16)
    store_args.setdefault("num_pages", -(-len(prefix) // page)
                          + len(users) * -(-len(ids) // page) + SPARE_PAGES)
    mem = Memory.create(directory, model=model_description(llm), **store_args)
    kv = capture(llm, prefix + ids)
    c = len(prefix)
    # Theorem 3's case is one forward of prefix + facts, so the prefix's K/V come from it too (a
    # forward of the prefix alone need not give the same bits: on an Intel Xeon with AMX, vLLM's
    # 18-token forward differs from this 205-token one in the last bits of every layer but the
    # first; on an AMD EPYC they were equal: bench/results/2026-12-05-vllm-amx.md).
    mem.set_prefix(SYSTEM, prefix, kv["k"][:, :c], kv["v"][:, :c])
    facts = {u: mem.add_fact(u, text, ids, kv["k"], kv["v"], context=prefix) for u in users}
    mem.commit()
    return mem, tok, facts, kv
