"""`builtin:chat`: chat prompts built locally for training a real chat model's draft.

The embedded default trains on what its target answers to these and is measured on MT-Bench,
so none of them is an MT-Bench question: each is a template of one of eight kinds of request
(writing, roleplay, reasoning, math, coding, extraction, science, humanities: the spread of
requests a chat model meets) filled from word lists, with about a third asking a follow-up
after the target's first answer (MT-Bench's second turn has that shape). The set is
deterministic in its index: row `i` is the same on every machine, and thousands are distinct.
"""

from __future__ import annotations

import random
from typing import Any

TOPICS = (
    "a lighthouse keeper",
    "a small bakery",
    "the first day of school",
    "a lost umbrella",
    "a mountain village",
    "a robot gardener",
    "an old library",
    "a night train",
    "a city market",
    "a winter storm",
    "a chess club",
    "a volunteer firefighter",
    "a desert road trip",
    "a coral reef",
    "a violin maker",
    "a family recipe",
    "a community garden",
    "a museum guard",
    "an abandoned factory",
    "a summer festival",
    "a fishing boat",
    "a space station cook",
    "a bicycle courier",
    "a forgotten letter",
    "a rainy afternoon",
    "a street musician",
)
STYLES = (
    "a short story",
    "a poem",
    "a diary entry",
    "a product description",
    "a news report",
    "a persuasive paragraph",
    "a friendly email",
    "a speech",
    "a limerick",
    "a dialogue",
)
ROLES = (
    "a pirate captain",
    "a medieval blacksmith",
    "a tour guide in Rome",
    "a detective",
    "a personal trainer",
    "a grumpy wizard",
    "a kindergarten teacher",
    "an astronaut",
    "a travel agent",
    "a chef at a busy restaurant",
    "a museum curator",
    "a football coach",
)
ROLE_ASKS = (
    "introduce yourself",
    "give me advice for my first week",
    "describe your typical day",
    "explain what you love about your work",
    "tell me about your biggest mistake",
    "convince me to try something new",
)
CONCEPTS = (
    "photosynthesis",
    "gravity",
    "the water cycle",
    "inflation",
    "vaccines",
    "black holes",
    "plate tectonics",
    "compound interest",
    "machine learning",
    "the immune system",
    "supply and demand",
    "electric circuits",
    "climate change",
    "DNA replication",
    "the greenhouse effect",
    "natural selection",
    "magnetism",
    "the speed of light",
)
AUDIENCES = (
    "a ten-year-old",
    "a high school student",
    "a busy manager",
    "my grandmother",
    "a university student",
    "someone who has never studied science",
)
EVENTS = (
    "the invention of the printing press",
    "the fall of the Roman Empire",
    "the Industrial Revolution",
    "the Renaissance",
    "the first moon landing",
    "the building of the pyramids",
    "the Silk Road",
    "the French Revolution",
    "the invention of writing",
    "the age of exploration",
)
CODE_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a text",
    "finds the largest element of a list",
    "merges two sorted lists",
    "computes the factorial of n",
    "removes duplicates from a list",
    "tests whether a word is a palindrome",
    "converts Celsius to Fahrenheit",
    "returns the n-th Fibonacci number",
    "sorts a list of names by length",
    "computes the average of a list of numbers",
)
LANGUAGES = ("Python", "JavaScript", "C", "Java", "Rust", "Go")
NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas")
CITIES = ("Lisbon", "Nairobi", "Osaka", "Toronto", "Lima", "Oslo", "Cairo", "Hanoi", "Dublin")
BUSINESSES = (
    "a bakery",
    "a bookshop",
    "a bicycle repair shop",
    "a small clinic",
    "a cafe",
    "a software company",
    "a language school",
    "a flower shop",
    "a recording studio",
)
FOLLOW_UPS = (
    "Now make it shorter, in at most three sentences.",
    "Can you explain that more simply?",
    "Give two more examples.",
    "Rewrite your answer as a numbered list.",
    "What is the most important point, in one sentence?",
    "Now say it in a more formal tone.",
    "What would be a common mistake here?",
    "Summarize your answer for a busy reader.",
)


def _writing(r: random.Random) -> str:
    return f"Write {r.choice(STYLES)} about {r.choice(TOPICS)}."


def _roleplay(r: random.Random) -> str:
    return f"Pretend you are {r.choice(ROLES)}. In character, {r.choice(ROLE_ASKS)}."


def _reasoning(r: random.Random) -> str:
    a, b, c = r.sample(NAMES, 3)
    n, m = r.randint(2, 9), r.randint(2, 9)
    return r.choice(
        (
            f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain.",
            f"{a} has {n} apples and gives {b} {min(n, m)} of them. Then {c} gives {a} {m} more. "
            f"How many apples does {a} have now? Think step by step.",
            f"If every {r.choice(('cat', 'bird', 'fish'))} in a town is {r.choice(('small', 'quiet', 'fast'))} "
            f"and {a} owns one, what can we say about {a}'s pet? What can we not say?",
            f"{a}, {b} and {c} sit in a row. {a} is not in the middle and {c} is left of {a}. "
            "Give every seating order that fits.",
        )
    )


def _math(r: random.Random) -> str:
    x, y, z = r.randint(3, 99), r.randint(3, 99), r.randint(2, 12)
    return r.choice(
        (
            f"What is {x} times {y}? Show your working.",
            f"Solve for x: {z}x + {x} = {x + z * y}.",
            f"A shop sells pens at {z} dollars each. How much do {x} pens cost, with a {y % 30 + 5}% discount?",
            f"What is the area of a rectangle {x} cm long and {y} cm wide, and its perimeter?",
            f"Is {x * y + 1} a prime number? Explain how you checked.",
            f"A train travels {x * 10} km in {z} hours. What is its average speed?",
        )
    )


def _coding(r: random.Random) -> str:
    return f"Write a {r.choice(LANGUAGES)} function that {r.choice(CODE_TASKS)}, and explain how it works."


def _extraction(r: random.Random) -> str:
    a, b = r.sample(NAMES, 2)
    city, year = r.choice(CITIES), r.randint(1990, 2025)
    text = (
        f"In {year}, {a} moved to {city} to open {r.choice(BUSINESSES)}. Two years later {b} joined "
        f"as a partner, and together they hired {r.randint(3, 40)} people."
    )
    return r.choice(
        (
            f'From this text, list every person, place and year as JSON: "{text}"',
            f'Read this and answer: who joined later, and when? "{text}"',
            f'Summarize in one sentence: "{text}"',
        )
    )


def _science(r: random.Random) -> str:
    return f"Explain {r.choice(CONCEPTS)} to {r.choice(AUDIENCES)}."


def _humanities(r: random.Random) -> str:
    return r.choice(
        (
            f"What were the main causes and effects of {r.choice(EVENTS)}?",
            f"Why is {r.choice(EVENTS)} important today? Give three reasons.",
            f"Compare {r.choice(EVENTS)} with {r.choice(EVENTS)}.",
        )
    )


KINDS = {
    "writing": _writing,
    "roleplay": _roleplay,
    "reasoning": _reasoning,
    "math": _math,
    "coding": _coding,
    "extraction": _extraction,
    "science": _science,
    "humanities": _humanities,
}


def chat_row(i: int, seed: int = 0) -> dict[str, Any]:
    """Row `i`: the kinds in turn; a user turn, and every third row an assistant turn and a follow-up."""
    kind = list(KINDS)[i % len(KINDS)]
    r = random.Random(f"{seed}:{i}")
    messages = [{"role": "user", "content": KINDS[kind](r)}]
    if i % 3 == 2:
        # The assistant turn is a placeholder the target's own answer replaces (regeneration).
        messages += [
            {"role": "assistant", "content": "(answered by the target)"},
            {"role": "user", "content": r.choice(FOLLOW_UPS)},
        ]
    return {
        "kind": "chat",
        "messages": messages,
        "text": "",
        "input_ids": [],
        "loss_mask": [],
        "origin": f"builtin:chat: row {i} ({kind})",
    }


def chat_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    return [chat_row(i, seed) for i in range(n)]
