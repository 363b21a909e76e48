"""What a ``kvtrim eval`` sweep runs: the plan (tasks x lengths x methods x budgets), checked before
any model loads, and the per-task token limits.

Every method in a plan must be replayable on a text prompt: a method that changes the forward pass
(``Policy.rewrites_forward``) or acts only on tagged modality spans (``Policy.needs_spans``) is
refused with a pointer to ``kvtrim generate --image``. ``full`` is always part of a plan: it is
every score's reference (and ``labelfree``'s reference answer); at 16 bits, the model's dtype.

``kv_bits`` (``--kv-bits 16,8,4``) runs every configuration at each bit width
(``KVTrimCache(kv_bits=)``, ``kvtrim.lowbit_storage``); 16 alone (the default) is the sweep as it
was before bit widths, with the same lines and keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtrim import validate
from kvtrim.errors import KVTrimError
from kvtrim.eval.longtext import LONGTEXT_TASKS
from kvtrim.eval.tasks import TASKS, even_depths, sample_seed
from kvtrim.validate import comma_list

ALL_TASKS = {**TASKS, **LONGTEXT_TASKS}

#: greedy tokens per answer (per turn for multiturn); ppl teacher-forces instead of generating
MAX_NEW_TOKENS = {"passkey": 12, "niah_single": 28, "niah_multikey": 28, "niah_multivalue": 64,
                  "niah_multiquery": 64, "vt": 40, "cwe": 64, "fwe": 32, "multiturn": 24, "labelfree": 32, "ppl": 0,
                  "niah_phrase": 28}
# (the model restates the question before the answer: "The special magic number for X mentioned in the
# provided text is 1234567" is ~25 tokens; this tokenizer splits numbers into single digits)

#: tokens a task adds after the prompt besides the answer (ppl's teacher-forced continuation)
LONGTEXT_EXTRA = {"ppl": 128}

DEFAULT_KEEPS = (0.1, 0.25, 0.5)
DEFAULT_METHODS = ("full", "streaming_llm", "h2o", "snapkv")

#: the reference configuration every sweep includes
REFERENCE = "full"

#: parameters that give a method its own budget: ``snapkv:max_tokens=512`` runs once at that fixed
#: budget (the same number of tokens whatever the prompt's length, as ``kvtrim chat`` holds), not at
#: each ``--keep``; its lines have ``keep`` null and the budget in ``params``
OWN_BUDGET = frozenset({"max_tokens", "keep"})


@dataclass
class EvalPlan:
    """What a sweep runs. Build it with :func:`make_plan`, which checks every field."""

    tasks: list[str]
    lengths: list[int]
    methods: list[str]
    keeps: list[float]
    samples: int = 20
    seed: int = 0
    prefill: str = "dense"
    haystack: str | None = None
    configs: list[tuple[str, float | None]] = field(default_factory=list)
    plain: bool = False  # prompts in kvtrim's plain format even when the tokenizer has a chat template
    kv_bits: list[int] = field(default_factory=lambda: [16])  # bit widths each configuration runs at

    def bit_configs(self) -> list[tuple[str, float | None, int]]:
        """(method, keep, kv_bits) for every configuration at every bit width, 16 bits first."""
        return [(m, k, b) for b in self.kv_bits for m, k in self.configs]

    def units(self) -> list[tuple[str, int, int]]:
        """(task, length, sample index) in the order they run: by length, then sample (even indices
        first, so a partial sweep still spans all depths), then task -- every task progresses together."""
        order = list(range(0, self.samples, 2)) + list(range(1, self.samples, 2))
        return [(t, n, i) for n in self.lengths for i in order for t in self.tasks]


def make_plan(tasks, lengths, methods, keeps, samples: int = 20, seed: int = 0, prefill: str = "dense",
              haystack: str | None = None, plain: bool = False, kv_bits="16") -> EvalPlan:
    """Validate a sweep (names, ranges) before any model loads; raises ``KVTrimError`` naming the problem."""
    from kvtrim.eval.common import MIN_LENGTH
    from kvtrim.integrations.prefill import PREFILL_MODES
    from kvtrim.registry import create_policy, get_policy_class, method_names, split_method

    task_list = comma_list(tasks, "the tasks argument")
    for t in task_list:
        if t not in ALL_TASKS:
            raise KVTrimError(f"unknown task {t!r}; known tasks: {', '.join(ALL_TASKS)}")
    method_list = comma_list(methods, "--methods")
    for m in method_list:
        name, params = split_method(m)  # a method may carry parameters: snapkv:layers=adaptive
        if name not in method_names():
            raise KVTrimError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
        cls = get_policy_class(name)
        if params:
            create_policy(name, **params)  # every parameter checked now, by the policy class itself
        if cls.rewrites_forward or cls.needs_spans:
            raise KVTrimError(
                f"method {m!r} compresses visual tokens only; the eval tasks are text, so it would equal 'full'. "
                "Evaluate it on images with kvtrim generate --image (see docs/multimodal.md)"
            )
    try:
        length_list = [int(x) for x in comma_list(lengths, "--length")]
    except ValueError:
        raise KVTrimError(f"--length takes comma-separated token counts, e.g. 2048,4096; got {lengths!r}") from None
    for n in length_list:
        if n < MIN_LENGTH:
            raise KVTrimError(f"--length must be >= {MIN_LENGTH} tokens; got {n}")
    try:
        keep_list = [float(x) for x in comma_list(keeps, "--keep")]
    except ValueError:
        raise KVTrimError(f"--keep takes comma-separated fractions, e.g. 0.1,0.25,0.5; got {keeps!r}") from None
    for k in keep_list:
        if not (0.0 < k < 1.0) or math.isnan(k):
            raise KVTrimError(f"--keep must be a fraction in (0, 1) (1 is the full cache, run as method 'full'); got {k}")
    validate.integer(samples, "--samples", minimum=1)
    validate.integer(seed, "--seed", minimum=0)
    bits_list = check_bit_list(kv_bits)
    if prefill not in PREFILL_MODES:
        raise KVTrimError(f"unknown --prefill {prefill!r}; choose one of: {', '.join(PREFILL_MODES)}")
    if REFERENCE not in method_list:
        method_list = [REFERENCE, *method_list]
    configs: list[tuple[str, float | None]] = []
    for m in dict.fromkeys(method_list):
        name, params = split_method(m)
        if get_policy_class(name).takes_budget and not OWN_BUDGET.intersection(params):
            configs += [(m, k) for k in dict.fromkeys(keep_list)]
        else:  # no budget, or its own (snapkv:max_tokens=512): once, not at each --keep
            configs.append((m, None))
    return EvalPlan(task_list, list(dict.fromkeys(length_list)), list(dict.fromkeys(method_list)),
                    list(dict.fromkeys(keep_list)), samples, seed, prefill, haystack, configs, bool(plain), bits_list)


def check_bit_list(kv_bits) -> list[int]:
    """``--kv-bits`` of a sweep: comma-separated bit widths (text, an int or a sequence), each in
    ``kvtrim.cache.KV_BITS``; 16 is always added, first (the full cache at 16 bits is every score's
    reference). ``KVTrimError`` naming what is allowed."""
    from kvtrim.cache import KV_BITS

    given = kv_bits if isinstance(kv_bits, (str, list, tuple)) else [kv_bits]
    out = []
    for b in comma_list(given, "--kv-bits"):
        if isinstance(kv_bits, bool) or not b.isdigit() or int(b) not in KV_BITS:
            raise KVTrimError(f"--kv-bits takes comma-separated bit widths from {', '.join(map(str, KV_BITS))}, "
                              f"e.g. 16,8,4; got {b!r}")
        out.append(int(b))
    return [16] + [b for b in dict.fromkeys(out) if b != 16]


def check_lengths(plan: EvalPlan, tokenizer, max_context: int) -> None:
    """Refuse lengths whose prompt (with the chat template and the answer) exceeds the model's context.

    kvtrim eval runs each prompt in one prefill (its forward pass is shared by all methods), so
    every method needs the prompt inside the context; a streaming method can go further with
    ``kvtrim stream`` / ``kvtrim.Session``, not here.
    """
    if not max_context:
        return
    from kvtrim.models import build_prompt_ids

    overhead = max(0, len(build_prompt_ids(tokenizer, "x", plain=plan.plain)) - len(tokenizer("x", add_special_tokens=False)["input_ids"]))
    for task in plan.tasks:
        # beyond the prompt: the template, the 2% length tolerance, the answer(s), later turns, ppl's continuation
        extra = overhead + MAX_NEW_TOKENS[task] + LONGTEXT_EXTRA.get(task, 0)
        if task == "multiturn":
            extra += 4 * (MAX_NEW_TOKENS[task] + 40)
        for n in plan.lengths:
            need = n + int(n * 0.02) + extra
            if need > max_context:
                limit = int((max_context - extra) / 1.02)
                raise KVTrimError(
                    f"--length {n} for task {task!r} needs up to {need} tokens (prompt + template + answer), more than "
                    f"the model's context of {max_context}; methods {', '.join(plan.methods)} run the prompt in one "
                    f"prefill and cannot stream past it. Use --length <= {limit}, or stream long inputs with "
                    "`kvtrim stream` (streaming methods)."
                )


def build_sample(plan: EvalPlan, tokenizer, task: str, length: int, i: int):
    """Sample ``i`` of ``task`` at ``length`` tokens (seed ``sample_seed(plan.seed, i)``, depths spread evenly)."""
    depth = even_depths(plan.samples)[i]
    kw = {} if plan.haystack is None else {"haystack": plan.haystack}
    return ALL_TASKS[task](tokenizer, length, depth=depth, seed=sample_seed(plan.seed, i), **kw)
