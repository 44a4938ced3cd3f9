"""Documents holding facts no model can know, with a question and its answer for each.

Made from a seed (no data file to ship or fetch): invented names built from syllables,
slotted into a few sentence shapes. Each document states one asked fact among two
distractor sentences about the same invented entity, so an answer has to pick the right
sentence from its sources, and a model can only get the fact from retrieval.

Used by the loop benchmark (``python -m benchmarks.loop``) and answer evaluations: a
``Fact`` knows its question, the expected answer string, the sentence that states it, and
the document it lives in.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "nd", "rk"]
_MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
_PRODUCTS = [
    "copper kettles",
    "wool blankets",
    "glass lenses",
    "bicycle bells",
    "paper lanterns",
    "clay roof tiles",
    "brass compasses",
    "linen sails",
    "wooden clocks",
    "silver spoons",
    "leather saddles",
    "cedar canoes",
]
_FOODS = [
    "river snails",
    "pine seeds",
    "moss",
    "beetles",
    "reed roots",
    "small crabs",
    "lichen",
    "fig leaves",
]
_COLOURS = ["green", "amber", "violet", "grey", "crimson", "blue", "white", "ochre"]


@dataclass(frozen=True)
class Fact:
    fact_id: str
    title: str
    text: str  # the whole document
    sentence: str  # the sentence that states the fact
    question: str
    answer: str


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)]
    return "".join(parts).capitalize()


class _Names:
    """Unique invented names (never the same twice in one set)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def __call__(self, syllables: int = 2) -> str:
        while True:
            name = _word(self.rng, syllables)
            if name.lower() not in self.used and len(name) >= 4:
                self.used.add(name.lower())
                return name

    def person(self) -> str:
        return f"{self(2)} {self(3)}"


# Each shape returns (title, asked sentence, distractor sentences, question, answer).
Shape = Callable[[random.Random, _Names], tuple[str, str, list[str], str, str]]


def _inventor(rng: random.Random, n: _Names) -> tuple[str, str, list[str], str, str]:
    device, person, city = f"{n()} loom", n.person(), n()
    year = rng.randint(1710, 1960)
    return (
        f"The {device}",
        f"The {device} was invented by {person} in {year}.",
        [f"It was first used in the workshops of {city}.", f"Its frame is painted {rng.choice(_COLOURS)}."],
        f"Who invented the {device}?",
        person,
    )


def _river_town(rng: random.Random, n: _Names) -> tuple[str, str, list[str], str, str]:
    town, river = n(), n()
    return (
        f"{town}",
        f"The town of {town} lies on the river {river}.",
        [
            f"{town} has {rng.randint(2, 90) * 100} inhabitants.",
            f"Its market square has a clock tower from {rng.randint(1500, 1900)}.",
        ],
        f"On which river does the town of {town} lie?",
        river,
    )


def _company(rng: random.Random, n: _Names) -> tuple[str, str, list[str], str, str]:
    company, city = f"{n()} Works", n()
    product = rng.choice(_PRODUCTS)
    return (
        company,
        f"{company} makes {product} in its factory in {city}.",
        [
            f"{company} was founded in {rng.randint(1820, 1990)}.",
            f"It employs {rng.randint(12, 900)} people.",
        ],
        f"What does {company} make?",
        product,
    )


def _festival(rng: random.Random, n: _Names) -> tuple[str, str, list[str], str, str]:
    festival, town = n(), n()
    month = rng.choice(_MONTHS)
    return (
        f"The {festival} festival",
        f"The {festival} festival is held every {month} in {town}.",
        [
            f"Visitors carry {rng.choice(_COLOURS)} lanterns through the streets.",
            f"The festival lasts {rng.randint(2, 9)} days.",
        ],
        f"In which month is the {festival} festival held?",
        month,
    )


def _mayor(rng: random.Random, n: _Names) -> tuple[str, str, list[str], str, str]:
    town, person = n(), n.person()
    return (
        f"History of {town}",
        f"The first mayor of {town} was {person}, elected in {rng.randint(1780, 1950)}.",
        [
            f"{town} received its charter from the duke of {n()}.",
            f"The town hall was rebuilt after a fire in {rng.randint(1800, 1990)}.",
        ],
        f"Who was the first mayor of {town}?",
        person,
    )


def _lake(rng: random.Random, n: _Names) -> tuple[str, str, list[str], str, str]:
    lake = n()
    depth = rng.randint(12, 480)
    return (
        f"Lake {lake}",
        f"Lake {lake} reaches a depth of {depth} metres.",
        [
            f"Its water is {rng.choice(_COLOURS)} in summer.",
            f"The lake freezes over about once every {rng.randint(3, 30)} years.",
        ],
        f"How deep is Lake {lake}?",
        f"{depth} metres",
    )


def _species(rng: random.Random, n: _Names) -> tuple[str, str, list[str], str, str]:
    species = f"{n()} {n().lower()}"
    food = rng.choice(_FOODS)
    return (
        f"The {species}",
        f"The {species} is a small lizard that feeds on {food}.",
        [
            f"It lives only in the hills of {n()}.",
            f"Its back is {rng.choice(_COLOURS)} with dark stripes.",
        ],
        f"What does the {species} feed on?",
        food,
    )


def _ship(rng: random.Random, n: _Names) -> tuple[str, str, list[str], str, str]:
    ship, city = n(), n()
    year = rng.randint(1650, 1970)
    return (
        f"The ship {ship}",
        f"The ship {ship} was launched in {year} at the docks of {city}.",
        [f"It carried {rng.randint(20, 400)} passengers.", f"Its captain was {n.person()}."],
        f"In which year was the ship {ship} launched?",
        str(year),
    )


def _mountain(rng: random.Random, n: _Names) -> tuple[str, str, list[str], str, str]:
    mountain, person = f"Mount {n()}", n.person()
    return (
        mountain,
        f"{mountain} was first climbed by {person}.",
        [f"{mountain} is {rng.randint(900, 6900)} metres high.", f"Its slopes are covered in {n()} pines."],
        f"Who first climbed {mountain}?",
        person,
    )


SHAPES: list[Shape] = [_inventor, _river_town, _company, _festival, _mayor, _lake, _species, _ship, _mountain]


def make_facts(count: int, seed: int = 0) -> list[Fact]:
    """``count`` facts, each in its own document; the same seed gives the same set."""
    rng = random.Random(seed)
    names = _Names(rng)
    out = []
    for i in range(count):
        shape = SHAPES[i % len(SHAPES)]
        title, sentence, others, question, answer = shape(rng, names)
        # The asked sentence is not always first, so "copy the first line" is not a strategy.
        # Distractors name their entity instead of "It", since they may come first.
        body = [re.sub(r"^Its ", f"{title}'s ", re.sub(r"^It ", f"{title} ", o)) for o in others]
        body.insert(rng.randint(0, len(body)), sentence)
        out.append(
            Fact(
                fact_id=f"fact-{seed}-{i:04d}",
                title=title,
                text=" ".join(body),
                sentence=sentence,
                question=question,
                answer=answer,
            )
        )
    return out


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"[^a-z0-9 ]+", " ", text.lower())).strip()


def states(answer: str, expected: str) -> bool:
    """The expected answer appears in the answer (case, punctuation and spacing ignored)."""
    return f" {normalise(expected)} " in f" {normalise(answer)} "
