"""Text workloads for the speculative bench on a real model (`tokenforge bench spec`).

grounded: rewrite, summarize or proofread a given passage (the answer copies much of its input,
where prompt lookup shines); grounded-held-out: the same over 14 other passages; chat: the
built-in chat prompts (train/chat_prompts.py) past the first `skip`, so a head trained by
`tokenforge train --draft-head eagle --num-prompts skip` is measured on prompts it did not see. The passages are this project's own prose.
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

# grounded-held-out: passages no proposer rule was tuned on (the n-gram rule of executor/spec/ngram.py
# was chosen on PASSAGES; these check it did not overfit them)
HELD_OUT_PASSAGES = (
    "The lighthouse on the northern cape was built in 1868 from granite blocks carried by boat from a "
    "quarry across the bay. Its lamp burned paraffin until 1931, when it was replaced by an electric "
    "light that can be seen from thirty kilometres at sea. For nearly a century three keepers and their "
    "families lived in the cottages beside the tower. The light was automated in 1987, and the cottages "
    "now house a small museum about shipwrecks and the lives of the keepers.",
    "To plant a young tree, dig a hole twice as wide as its root ball and about as deep. Loosen the soil "
    "at the bottom and the sides of the hole with a fork. Take the tree out of its pot, gently spread the "
    "roots, and set it in the hole so that the top of the root ball is level with the ground. Fill the "
    "hole with the soil you dug out, press it down firmly, and water the tree well. Water it once a week "
    "during its first summer.",
    "Octopuses are sea animals with eight arms, three hearts and blue blood. They have no bones, so they "
    "can squeeze through any gap larger than their beak. An octopus can change the colour and the texture "
    "of its skin in less than a second to hide from predators or to surprise its prey. Most species live "
    "alone, hunt crabs and shellfish at night, and live for only one or two years.",
    "The school will hold its annual science fair on the first Saturday of May in the sports hall. Every "
    "class from the fourth grade up will present at least one project, and parents are welcome from nine "
    "until one o'clock. Students must register their projects with their science teacher by the end of "
    "March and bring their posters and materials to the hall on Friday afternoon. Prizes will be given "
    "for the best experiment, the best poster and the most creative idea.",
    "Bread rises because of yeast, a tiny fungus that feeds on the sugars in flour. As the yeast eats, it "
    "releases carbon dioxide gas, which forms small bubbles in the dough. Kneading the dough builds a "
    "network of gluten that traps these bubbles, so the dough grows larger. When the bread is baked, the "
    "heat kills the yeast, the gas expands one last time, and the gluten and starch set into the soft, "
    "airy crumb we eat.",
    "The city council has approved a plan to add forty kilometres of protected bicycle lanes over the "
    "next five years. The first lanes will connect the train station with the university and the "
    "hospital, and later ones will reach the suburbs in the east and the west. The plan also includes two "
    "thousand new bicycle parking spaces, a rental scheme with electric bikes, and lower speed limits on "
    "the streets near schools.",
    "The museum's new exhibition shows how people in the region lived two hundred years ago. Visitors can "
    "walk through a farmhouse kitchen, a weaver's workshop and a village school, each furnished with "
    "original objects collected from nearby farms. Guides in period clothing explain how bread was baked, "
    "how wool was spun and how children learned to write on slates. The exhibition is open every day "
    "except Monday until the end of October.",
    "Volcanoes form where molten rock, called magma, rises from deep inside the Earth. When the pressure "
    "of the gas in the magma becomes too great, it breaks through the surface and the volcano erupts. "
    "Some eruptions are quiet, with rivers of lava flowing slowly down the slopes, while others are "
    "explosive and throw ash and rocks high into the sky. The ash can cover towns, ruin crops and stop "
    "air traffic for days.",
    "Before you start a long bicycle ride, check that both tyres are pumped to the pressure written on "
    "their sides. Make sure the brakes stop the wheels firmly and that the chain is clean and oiled. Pack "
    "a spare inner tube, a small pump, a bottle of water and something to eat. Wear a helmet and bright "
    "clothes, and tell someone which route you plan to take and when you expect to be back.",
    "The hotel has one hundred and twenty rooms on six floors, a restaurant that serves local food, and a "
    "small swimming pool on the roof. Breakfast is served from seven to ten in the dining room on the "
    "ground floor. Guests can leave their luggage at the reception desk after checking out, and the hotel "
    "offers a free shuttle bus to the airport every hour between six in the morning and ten at night.",
    "Penguins are birds that cannot fly, but they are excellent swimmers. Their wings have become stiff "
    "flippers that push them through the water at up to ten kilometres an hour. Most penguins live in the "
    "southern half of the world, from the ice of Antarctica to the warm coasts of South Africa and the "
    "Galapagos Islands. They eat fish, squid and krill, and many species dive more than a hundred metres "
    "deep to find their food.",
    "The company will move to its new offices near the harbour at the beginning of September. The new "
    "building has more meeting rooms, a larger kitchen and a roof terrace where staff can eat lunch in "
    "good weather. Each team will receive boxes for packing in the last week of August, and the movers "
    "will carry the furniture over the weekend. Please label every box with your name and your team, and "
    "take your plants home before the move.",
    "Coffee was first grown in the highlands of Ethiopia, and by the fifteenth century it was drunk "
    "across Yemen and the rest of Arabia. Coffee houses soon opened in Cairo, Istanbul and other cities, "
    "where people met to talk, play games and listen to music. In the seventeenth century the drink "
    "reached Europe, and within a few decades London alone had hundreds of coffee houses, some of which "
    "later became banks and insurance companies.",
    "To clean a cast iron pan, rinse it with hot water while it is still warm and scrub off any food with "
    "a stiff brush. Avoid soaking the pan or putting it in the dishwasher, because the iron will rust. "
    "Dry it completely with a towel, then heat it on the stove for a minute to remove the last of the "
    "moisture. Finally, rub a few drops of oil over the inside of the pan with a paper towel and let it "
    "cool before you put it away.",
)

INSTRUCTIONS = (
    "Rewrite the following text in clear and simple English, keeping every fact:\n\n{p}",
    "Summarize the following text in a few sentences:\n\n{p}",
    "Correct any mistakes in the following text and return the corrected text:\n\n{p}",
)


def grounded_prompts(n: int, passages: tuple[str, ...] = PASSAGES) -> list[str]:
    """`n` user messages (passage x instruction, cycled)."""
    pairs = [ins.format(p=p) for ins in INSTRUCTIONS for p in passages]
    return [pairs[i % len(pairs)] for i in range(n)]


def held_out_prompts(n: int) -> list[str]:
    return grounded_prompts(n, HELD_OUT_PASSAGES)


def chat_prompts(n: int, skip: int = 256, seed: int = 0) -> list[str]:
    """`n` built-in chat prompts after the first `skip` of the same shuffle (held out from training)."""
    from tokenforge.train.chat_prompts import chat_prompts as all_prompts  # noqa: PLC0415

    prompts = all_prompts(10 ** 6, seed)
    held_out = prompts[skip:] or prompts
    return [held_out[i % len(held_out)] for i in range(n)]


WORKLOADS = {"grounded": grounded_prompts, "grounded-held-out": held_out_prompts, "chat": chat_prompts}
