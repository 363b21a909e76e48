"""``niah_phrase``: natural-sentence needles whose answer spans several tokens.

The RULER needles (``niah_*``) and the pass key share one template ("The special magic number
for X is: 1234567.", "The pass key is 12345. Remember it: 12345 is the pass key."), and their
answers are numbers the pass key even repeats. A selection that keeps the needle's start but cuts
its last token passes them more often than it should. This task writes the needle as an ordinary
sentence of a story, in one of several wordings, and asks for an answer of several tokens,
from one of four families (``family``):

- ``code``: a code of ``code_digits`` digits (default 4; SmolLM2's and Qwen's tokenizers split
  numbers into single digits), e.g. "... the code for the boathouse was 4821.";
- ``compound``: a compound noun ("flowerpot", "wheelbarrow"), which the tokenizers split into
  parts: answering its first part ("flower") scores 0;
- ``name``: a first name and a rare surname ("Thaddeus Quillfeather");
- ``phrase``: three words ("silver otter singing").

``family="mixed"`` (the default) takes ``FAMILIES[seed % 4]``, so the samples of a sweep
(consecutive seeds) rotate through the four. The answer occurs once in the context, only in its
needle (it is drawn absent from the haystack). Scored by containment with the word-boundary rule
of :mod:`kvtrim.eval.metrics` (a code answered with its first digits, or "flower" for
"flowerpot", scores 0).
"""

from __future__ import annotations

from kvtrim.errors import KVTrimError
from kvtrim.eval.common import (
    Sample,
    check_count,
    check_depth,
    check_length,
    cut,
    fit,
    insert_needles,
    join_prompt,
    make_rng,
    pick_window,
    require_room,
    unique_numbers,
    unique_values,
)

FAMILIES = ("code", "compound", "name", "phrase")

_PEOPLE = ("Margaret", "Tobias", "Eleanor", "Silas", "Harriet", "Jonah", "Beatrice", "Amos")
_PLACES = ("boathouse", "cellar door", "garden gate", "old piano", "iron chest", "tool shed", "clock tower", "wine rack")
_COMPOUNDS = ("flowerpot", "wheelbarrow", "birdhouse", "woodpile", "lampshade", "footstool", "breadbox", "washtub",
              "scarecrow", "rowboat", "sandbox", "doghouse", "teapot", "toolbox", "washboard")
_FIRST = ("Bartholomew", "Cornelius", "Ignatius", "Leopold", "Thaddeus", "Percival", "Ambrose", "Evander",
          "Lysander", "Octavian")
_LAST = ("Quillfeather", "Ashgrove", "Merriweather", "Thistlewood", "Blackwater", "Fennimore", "Hollowell",
         "Kettleby", "Underhill", "Winterbourne")
_ADJ = ("silver", "crimson", "sleepy", "hollow", "velvet", "frozen", "golden", "restless")
_NOUN = ("otter", "lantern", "harbor", "falcon", "orchard", "compass", "meadow", "anchor")
_VERB = ("singing", "drifting", "waiting", "burning", "turning", "falling", "sleeping", "rising")

# (needle, question) wordings per family; {who} a person, {what} a place, {answer} the answer
_WORDINGS = {
    "code": (
        ("Before she left for the winter, {who} told her brother that the code for the {what} was {answer}.",
         "What was the code for the {what}? Reply with the code only."),
        ("The lock on the {what} opens with the code {answer}, which {who} chose years ago.",
         "Which code opens the lock on the {what}? Reply with the code only."),
    ),
    "compound": (
        ("On the last morning {who} hid the spare key under the {answer} by the kitchen door.",
         "Where did {who} hide the spare key?"),
        ("That summer {who} painted the {answer} in the yard a bright blue.",
         "Which thing in the yard did {who} paint blue that summer?"),
    ),
    "name": (
        ("The man who came every spring to repair the {what} was called {answer}.",
         "What was the name of the man who repaired the {what}? Reply with the full name."),
        ("{who} sold the {what} to a stranger named {answer} and never saw it again.",
         "What was the name of the stranger who bought the {what}? Reply with the full name."),
    ),
    "phrase": (
        ("The password for the {what} was {answer}, and only {who} knew it.",
         "What was the password for the {what}? Reply with the password only."),
        ("Inside the lid of the {what}, {who} had written the words {answer}.",
         "Which words had {who} written inside the lid of the {what}? Reply with the words only."),
    ),
}

INSTRUCTION = "Read the story below, then answer the question at the end."


def _draw_answer(family: str, rng, window: str, code_digits: int) -> str:
    if family == "code":
        return unique_numbers(rng, 1, code_digits, window)[0]
    if family == "compound":
        return unique_values(rng, 1, window, lambda r: r.choice(_COMPOUNDS), "compound words")[0]
    if family == "name":
        return unique_values(rng, 1, window, lambda r: f"{r.choice(_FIRST)} {r.choice(_LAST)}", "names")[0]
    return unique_values(rng, 1, window, lambda r: f"{r.choice(_ADJ)} {r.choice(_NOUN)} {r.choice(_VERB)}", "phrases")[0]


def niah_phrase(tokenizer, length: int, depth: float = 0.5, seed: int = 0, haystack: str | None = None,
                family: str = "mixed", code_digits: int = 4) -> Sample:
    """One natural-sentence needle at ``depth`` whose answer spans several tokens (a code, a compound
    noun, a full name or a three-word phrase; ``family``, see the module); scored by containment."""
    task = "niah_phrase"
    check_length(task, length)
    depth = check_depth(task, depth)
    check_count(task, "code_digits", code_digits, 2)
    if family not in (*FAMILIES, "mixed"):
        raise KVTrimError(f"{task}: family must be one of {', '.join((*FAMILIES, 'mixed'))}, got {family!r}")
    if family == "mixed":
        family = FAMILIES[seed % len(FAMILIES)]
    rng = make_rng(task, seed)
    window, ratio, hay_name = pick_window(task, tokenizer, length, rng, haystack)
    who, what = rng.choice(_PEOPLE), rng.choice(_PLACES)
    needle_form, question_form = rng.choice(_WORDINGS[family])
    answer = _draw_answer(family, rng, window, code_digits)
    needle = needle_form.format(who=who, what=what, answer=answer)
    question = question_form.format(who=who, what=what)
    fixed = require_room(task, tokenizer, length, join_prompt(INSTRUCTION, needle, question))

    def build(n):
        context, positions = insert_needles(cut(window, n), [(depth, needle)])
        return join_prompt(INSTRUCTION, context, question), (context, positions)

    (context, positions), n_tok = fit(task, tokenizer, length, build, int((length - fixed) * ratio), ratio)
    meta = {"family": family, "answer": answer, "needles": [needle], "positions": positions, "haystack": hay_name}
    return Sample(task, context, question, [answer], n_tok, (depth,), seed, length, "contains", INSTRUCTION, (), meta)
