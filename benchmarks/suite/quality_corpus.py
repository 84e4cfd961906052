"""The quality section's corpus, written by the project (no data set is downloaded).

Each set is 2-4 short documents about fictional places, each document holding one fact
(a made-up code, colour, animal or number) at a chosen depth among filler sentences, and
a question about the fact of one of them. Documents are cached alone; the prompt puts them
in an order that was never cached. Everything is drawn from a fixed seed, so the corpus is
the same on every run.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

PLACES = [
    "Orvia", "Belmarsh", "Quillon", "Tessaro", "Marwick", "Dunhollow", "Saltmere", "Verran", "Kestrel Bay",
    "Ashcombe", "Lindqvist", "Porthallow", "Caldera Rim", "Windle", "Yarrowfield", "Hestia Point", "Brackwater",
    "Feldspar", "Oakhurst", "Pellmoor", "Riverton", "Galloway Cross", "Emberly", "Norhaven", "Thistledown",
    "Corvane", "Mistral", "Highgarth", "Selby Reach", "Ironvale",
]  # fmt: skip
KINDS: list[tuple[str, Callable[[random.Random], str]]] = [
    ("the secret door code of {p}", lambda r: str(r.randint(1000, 9999))),
    ("the colour of the flag of {p}", lambda r: r.choice(["purple", "orange", "green", "yellow", "silver", "red"])),
    ("the animal on the coat of arms of {p}", lambda r: r.choice(["otter", "falcon", "badger", "heron", "lynx", "goat"])),
    ("the number of bridges in {p}", lambda r: str(r.randint(12, 97))),
]  # fmt: skip
FILLER = [
    "{p} lies in a quiet valley and is known for its markets.",
    "Visitors to {p} often remark on the old stone houses.",
    "The weather in {p} is mild for most of the year.",
    "Many families in {p} have lived there for generations.",
    "The main road through {p} was rebuilt ten years ago.",
    "A small museum in {p} keeps maps of the region.",
    "Farmers around {p} grow wheat, barley and apples.",
    "The library of {p} opens every morning except Sunday.",
    "Children in {p} learn to swim in the river each summer.",
    "Trains stop at {p} twice a day on the northern line.",
]


@dataclass(frozen=True, slots=True)
class QASet:
    """One question over its documents (in the composed order); ``asked``: the index of
    the document holding the answer; ``depth``: the fact's sentence index in it."""

    documents: tuple[str, ...]
    question: str
    answer: str
    asked: int
    depth: int


def _document(rng: random.Random, place: str, kind: int, depth: int, sentences: int) -> tuple[str, str, str]:
    phrase, draw = KINDS[kind]
    fact = phrase.format(p=place)
    answer = draw(rng)
    filler = rng.sample(FILLER, sentences - 1)
    lines = [f.format(p=place) for f in filler]
    lines.insert(depth, f"{fact[0].upper()}{fact[1:]} is {answer}.")
    return f"## {place}\n" + " ".join(lines) + "\n\n", f"What is {fact}?", answer


def corpus(n: int = 60, *, seed: int = 0) -> list[QASet]:
    """``n`` question/document sets: 2-4 documents each, the asked document's fact at depth
    0 (first sentence), middle or last, the asked document first, inside or last."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = 2 + i % 3
        places = rng.sample(PLACES, k)
        sentences = 5
        docs, questions, answers, depths = [], [], [], []
        for j, place in enumerate(places):
            depth = (i // 3 + j) % 3 * 2  # 0, 2 or 4 of 5 sentences
            doc, q, a = _document(rng, place, (i + j) % len(KINDS), depth, sentences)
            docs.append(doc)
            questions.append(q)
            answers.append(a)
            depths.append(depth)
        asked = (i // 9) % k
        out.append(QASet(tuple(docs), questions[asked], answers[asked], asked, depths[asked]))
    return out
