"""RULER-style synthetic tasks (Hsieh et al., 2024), generated offline with the model's tokenizer.

- ``niah_single``: one ``key -> value`` needle; asked for the value.
- ``niah_multikey``: several keys with one value each; one key is asked, the others distract.
- ``niah_multivalue``: one key with several values; all of them must be returned.
- ``niah_multiquery``: several keys, all asked at once; all their values must be returned.
- ``vt`` (variable tracking): chains ``VAR A = 12345.``, ``VAR B = VAR A.``, ... hidden in the
  haystack; asked which variables hold the value.
- ``cwe`` (common words): a numbered word list where ``num_cw`` words repeat ``freq_cw`` times
  and the rest ``freq_ucw`` times; asked for the most common words.
- ``fwe`` (frequent words): coded words drawn with Zipf frequencies (RULER's exact counts);
  asked for the three most frequent (the most frequent one is the noise token ``....``).

Needle values never occur in the haystack elsewhere; keys, values and variable names are
distinct. Wording follows RULER's templates, with blank lines between instruction, context and
question. Lengths follow the convention in :mod:`kvtrim.eval.common`.
"""

from __future__ import annotations

from kvtrim.errors import KVTrimError
from kvtrim.eval.common import (
    Sample,
    check_count,
    check_depth,
    check_length,
    count_tokens,
    cut,
    fit,
    insert_needles,
    join_prompt,
    make_rng,
    pick_window,
    require_room,
    spread_depths,
    unique_keys,
    unique_names,
    unique_numbers,
    unique_uuids,
    word_pool,
)

VALUE_KINDS = ("number", "uuid")


def _join_keys(keys: list[str]) -> str:
    if len(keys) == 1:
        return keys[0]
    if len(keys) == 2:
        return f"{keys[0]} and {keys[1]}"
    return ", ".join(keys[:-1]) + ", and " + keys[-1]


def _niah(task, tokenizer, length, depth, seed, haystack, n_keys, n_values, n_queries, value_kind, metric):
    check_length(task, length)
    depth = check_depth(task, depth)
    check_count(task, "n_keys", n_keys)
    check_count(task, "n_values", n_values)
    if value_kind not in VALUE_KINDS:
        raise KVTrimError(f"{task}: value_kind must be one of {', '.join(VALUE_KINDS)}, got {value_kind!r}")
    rng = make_rng(task, seed)
    window, ratio, hay_name = pick_window(task, tokenizer, length, rng, haystack)
    keys = unique_keys(rng, n_keys, window, word_pool())
    if value_kind == "number":
        flat = unique_numbers(rng, n_keys * n_values, 7, window)
    else:
        flat = unique_uuids(rng, n_keys * n_values)
    values = {k: flat[i * n_values : (i + 1) * n_values] for i, k in enumerate(keys)}
    kind = "numbers" if value_kind == "number" else "uuids"
    one = kind[:-1]
    needles = [f"One of the special magic {kind} for {k} is: {v}." for k in keys for v in values[k]]
    depths = spread_depths(depth, len(needles), rng)
    queries = keys[:n_queries]
    instruction = (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind} afterwards."
    )
    if n_values == 1 and n_queries == 1:
        question = f"What is the special magic {one} for {queries[0]} mentioned in the provided text?"
    else:
        question = f"What are all the special magic {kind} for {_join_keys(queries)} mentioned in the provided text?"
    answers = [v for k in queries for v in values[k]]
    fixed = require_room(task, tokenizer, length, join_prompt(instruction, " ".join(needles), question))

    def build(n):
        context, positions = insert_needles(cut(window, n), list(zip(depths, needles)))
        return join_prompt(instruction, context, question), (context, positions)

    (context, positions), n_tok = fit(task, tokenizer, length, build, int((length - fixed) * ratio), ratio)
    meta = {"keys": keys, "values": values, "queries": queries, "needles": needles, "positions": positions,
            "haystack": hay_name}
    return Sample(task, context, question, answers, n_tok, tuple(depths), seed, length, metric, instruction, (), meta)


def niah_single(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None,
                value_kind: str = "number") -> Sample:
    """One ``word-word`` key with a 7-digit (or uuid) value at ``depth``; scored by containment."""
    return _niah("niah_single", tokenizer, length, depth, seed, haystack, 1, 1, 1, value_kind, "contains")


def niah_multikey(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None,
                  n_keys: int = 4, value_kind: str = "number") -> Sample:
    """``n_keys`` key/value needles; the asked one sits at ``depth``, distractors at random depths."""
    check_count("niah_multikey", "n_keys", n_keys, 2)
    return _niah("niah_multikey", tokenizer, length, depth, seed, haystack, n_keys, 1, 1, value_kind, "contains")


def niah_multivalue(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None,
                    n_values: int = 4, value_kind: str = "number") -> Sample:
    """One key with ``n_values`` values (first at ``depth``); scored by recall of all values."""
    check_count("niah_multivalue", "n_values", n_values, 2)
    return _niah("niah_multivalue", tokenizer, length, depth, seed, haystack, 1, n_values, 1, value_kind, "recall")


def niah_multiquery(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None,
                    n_keys: int = 4, value_kind: str = "number") -> Sample:
    """``n_keys`` keys, all asked at once (first at ``depth``); scored by recall of all values."""
    check_count("niah_multiquery", "n_keys", n_keys, 2)
    return _niah("niah_multiquery", tokenizer, length, depth, seed, haystack, n_keys, 1, n_keys, value_kind, "recall")


def vt(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None,
       n_chains: int = 1, n_hops: int = 4) -> Sample:
    """Variable tracking: the asked chain starts at ``depth``; its later hops follow at random
    depths in [depth, 1]; other chains (distractors, other values) anywhere. Recall of the
    ``n_hops + 1`` variable names."""
    task = "vt"
    check_length(task, length)
    depth = check_depth(task, depth)
    check_count(task, "n_chains", n_chains)
    check_count(task, "n_hops", n_hops)
    rng = make_rng(task, seed)
    window, ratio, hay_name = pick_window(task, tokenizer, length, rng, haystack)
    names = unique_names(rng, n_chains * (n_hops + 1), window)
    values = unique_numbers(rng, n_chains, 5, window)
    chains = [names[c * (n_hops + 1) : (c + 1) * (n_hops + 1)] for c in range(n_chains)]
    items: list[tuple[float, str]] = []
    for c, (chain, value) in enumerate(zip(chains, values)):
        if c == 0:
            ds = [depth] + sorted(round(rng.uniform(depth, 1.0), 4) for _ in range(n_hops))
        else:
            ds = sorted(round(rng.uniform(0.0, 1.0), 4) for _ in range(n_hops + 1))
        stmts = [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[j + 1]} = VAR {chain[j]}." for j in range(n_hops)]
        items.extend(zip(ds, stmts))
    instruction = "Memorize and track the chain(s) of variable assignment hidden in the following text."
    question = f"Question: Find all variables that are assigned the value {values[0]} in the text above."
    fixed = require_room(task, tokenizer, length, join_prompt(instruction, " ".join(t for _, t in items), question))

    def build(n):
        context, positions = insert_needles(cut(window, n), items)
        return join_prompt(instruction, context, question), (context, positions)

    (context, positions), n_tok = fit(task, tokenizer, length, build, int((length - fixed) * ratio), ratio)
    meta = {"chains": chains, "values": values, "needles": [t for _, t in items], "positions": positions,
            "haystack": hay_name}
    return Sample(task, context, question, list(chains[0]), n_tok, tuple(d for d, _ in items), seed, length,
                  "recall", instruction, (), meta)


def cwe(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None,
        num_cw: int = 10, freq_cw: int | None = None, freq_ucw: int | None = None) -> Sample:
    """Common-words extraction. ``freq_cw``/``freq_ucw`` default to RULER's 30/3, or 6/1 below
    4096 tokens. The list grows by uncommon words to fit the length. ``depth`` and ``haystack``
    are checked but unused (no needles)."""
    task = "cwe"
    check_length(task, length)
    check_depth(task, depth)
    check_count(task, "num_cw", num_cw)
    if freq_cw is None:
        freq_cw = 30 if length >= 4096 else 6
    if freq_ucw is None:
        freq_ucw = 3 if length >= 4096 else 1
    check_count(task, "freq_cw", freq_cw, 2)
    check_count(task, "freq_ucw", freq_ucw)
    if freq_ucw >= freq_cw:
        raise KVTrimError(f"{task}: freq_ucw ({freq_ucw}) must be smaller than freq_cw ({freq_cw})")
    rng = make_rng(task, seed)
    pool = word_pool()
    words = rng.sample(pool, len(pool))
    common, rare = words[:num_cw], words[num_cw:]
    instruction = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.")
    question = f"Question: What are the {num_cw} most common words in the above list?"

    def build(n):
        seq = common * freq_cw + rare[:n] * freq_ucw
        make_rng(task, seed * 1_000_003 + n).shuffle(seq)
        context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(seq))
        return join_prompt(instruction, context, question), (context, n)

    fixed_prompt, _ = build(0)
    fixed = count_tokens(tokenizer, fixed_prompt)
    if length < fixed + 32:
        raise KVTrimError(f"{task}: length {length} is too small: the common words alone take {fixed} tokens; "
                          f"ask for at least {fixed + 32} or lower num_cw/freq_cw")
    per_word = (count_tokens(tokenizer, build(200)[0]) - fixed) / (200 * freq_ucw)
    n0 = int((length - fixed) / (per_word * freq_ucw))
    (context, n), n_tok = fit(task, tokenizer, length, build, n0, 1.0 / (per_word * freq_ucw), len(rare))
    meta = {"common": common, "freq_cw": freq_cw, "freq_ucw": freq_ucw, "n_uncommon": n}
    return Sample(task, context, question, list(common), n_tok, (), seed, length, "recall", instruction, (), meta)


def _coded_vocab(rng, size: int, wordlen: int) -> list[str]:
    vocab: set[str] = set()
    while len(vocab) < size:
        vocab.add("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=wordlen)))
    out = sorted(vocab)
    rng.shuffle(out)
    return out


def fwe(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None,
        alpha: float = 2.0, vocab_size: int = 2000, wordlen: int = 6) -> Sample:
    """Frequent-words extraction: word k of a random coded vocabulary appears
    ``int(N * k**-alpha / zeta(alpha))`` times (RULER's counts), shuffled; word 1 is the noise
    ``....``; the answers are words 2-4. ``depth`` and ``haystack`` are checked but unused."""
    task = "fwe"
    check_length(task, length)
    check_depth(task, depth)
    if not alpha > 1.0:
        raise KVTrimError(f"{task}: alpha must be > 1, got {alpha!r}")
    check_count(task, "vocab_size", vocab_size, 10)
    rng = make_rng(task, seed)
    vocab = _coded_vocab(rng, vocab_size, wordlen)
    vocab[0] = "...."
    zeta = sum(k ** -alpha for k in range(1, 100000)) + (100000 ** (1 - alpha)) / (alpha - 1)
    instruction = ("Read the following coded text and track the frequency of each coded word. "
                   "Find the three most frequently appeared coded words.")
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")

    def build(n):
        seq = []
        for k, w in enumerate(vocab, start=1):
            seq.extend([w] * int(n * k**-alpha / zeta))
        make_rng(task, seed * 1_000_003 + n).shuffle(seq)
        context = " ".join(seq)
        return join_prompt(instruction, context, question), context

    fixed = count_tokens(tokenizer, join_prompt(instruction, "", question))
    units_per_token = 1000 / max(1, count_tokens(tokenizer, build(1000)[0]) - fixed)
    n0 = int((length - fixed) * units_per_token)
    context, n_tok = fit(task, tokenizer, length, build, n0, units_per_token)
    answers = vocab[1:4]
    tokens = context.split()
    freq = {w: tokens.count(w) for w in vocab[:6]}
    if not freq[answers[2]] > freq[vocab[4]]:
        raise KVTrimError(f"{task}: length {length} is too small to separate the three most frequent words")
    meta = {"vocab_head": vocab[:6], "counts": freq, "alpha": alpha}
    return Sample(task, context, question, list(answers), n_tok, (), seed, length, "recall", instruction, (), meta)
