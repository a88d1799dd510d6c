"""Reference data: level-1 items like the eval's, half of them with a reminder of the answer format."""

from aitrainsai_family_multi_hop import generate

SEED = 777
SIZE = 512
HINT = " Reply with just <answer>...</answer>."


def build() -> list[dict]:
    rows = []
    for index, item in enumerate(generate(SEED, 1, SIZE)):
        question = item.question + (HINT if index % 2 else "")
        rows.append({"question": question, "answer": item.answer, "world": item.world})
    return rows
