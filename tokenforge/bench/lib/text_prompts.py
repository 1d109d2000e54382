"""Text workloads for the speculative bench on a real model (`tokenforge bench spec`).

grounded: rewrite, summarize or proofread a given passage (the answer copies much of its input,
where prompt lookup shines); chat: the built-in chat prompts (train/chat_prompts.py) past the
first `skip`, so a head trained by `tokenforge train --draft-head eagle --num-prompts skip` is
measured on prompts it did not see. The passages are this project's own prose.
"""

from __future__ import annotations

PASSAGES = (
    "The town library opened in 1952 in a single room above the post office. It held about two thousand "
    "books, most of them donated by local families, and it was run by volunteers who took turns at the desk "
    "on weekday evenings. In 1974 the library moved into a new brick building on Main Street, with a reading "
    "room, a children's corner and space for twenty thousand books. Today it lends books, films and tools, "
    "offers free internet access, and hosts a weekly reading hour for children and a monthly book club.",
    "To make a simple tomato sauce, heat two tablespoons of olive oil in a pan over medium heat. Add one "
    "chopped onion and cook it for five minutes, until it is soft. Add two cloves of garlic and cook for one "
    "more minute. Pour in a can of crushed tomatoes, add a pinch of salt and a teaspoon of sugar, and let the "
    "sauce simmer for twenty minutes, stirring now and then. Taste it, add pepper and fresh basil, and serve "
    "it with pasta or keep it in the fridge for up to four days.",
    "Honeybees live in colonies of up to sixty thousand insects. Each colony has one queen, who lays the eggs, "
    "a few hundred male drones, and thousands of female workers. The workers clean the hive, feed the young, "
    "build the wax comb, guard the entrance and collect nectar and pollen from flowers. A worker bee that "
    "finds a good patch of flowers returns to the hive and performs a dance that tells the other bees the "
    "direction and the distance of the food.",
    "Our team meeting will take place on Thursday at ten in the morning in the small conference room on the "
    "third floor. We will review the results of the last quarter, discuss the budget for the next one and "
    "plan the launch of the new website. Please bring your updated project reports and a list of the tasks "
    "you expect to finish before the end of the month. If you cannot attend, send your report to the team "
    "lead by Wednesday evening so that it can be shared with everyone.",
    "A rainbow appears when sunlight passes through drops of water in the air. As the light enters a drop, "
    "it bends, and because each colour bends by a slightly different amount, the white light spreads into a "
    "band of colours. The light reflects off the back of the drop and bends again as it leaves. This is why "
    "a rainbow always appears on the side of the sky opposite the sun, and why its colours are always in the "
    "same order: red, orange, yellow, green, blue, indigo and violet.",
    "The old railway line between the two villages closed in 1965, and for many years the track bed was "
    "overgrown with bushes and trees. In 2010 a group of residents began to clear it, and with the help of "
    "the local council they turned it into a walking and cycling path. The path is eleven kilometres long, "
    "flat and mostly shaded, and it passes three old stations, two bridges over the river and a small tunnel. "
    "Benches and information boards along the way tell the story of the railway.",
)

INSTRUCTIONS = (
    "Rewrite the following text in clear and simple English, keeping every fact:\n\n{p}",
    "Summarize the following text in a few sentences:\n\n{p}",
    "Correct any mistakes in the following text and return the corrected text:\n\n{p}",
)


def grounded_prompts(n: int) -> list[str]:
    """`n` user messages (passage x instruction, cycled)."""
    pairs = [ins.format(p=p) for ins in INSTRUCTIONS for p in PASSAGES]
    return [pairs[i % len(pairs)] for i in range(n)]


def chat_prompts(n: int, skip: int = 256, seed: int = 0) -> list[str]:
    """`n` built-in chat prompts after the first `skip` of the same shuffle (held out from training)."""
    from tokenforge.train.chat_prompts import chat_prompts as all_prompts  # noqa: PLC0415

    prompts = all_prompts(10 ** 6, seed)
    held_out = prompts[skip:] or prompts
    return [held_out[i % len(held_out)] for i in range(n)]


WORKLOADS = {"grounded": grounded_prompts, "chat": chat_prompts}
