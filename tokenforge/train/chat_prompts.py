"""Built-in chat prompts for self-distillation (`tokenforge train --draft-head eagle`): the target
answers them itself, so no dataset is downloaded. Tasks x topics give a few hundred distinct
requests of the kinds a chat server meets (explain, list, compare, write, code, summarize)."""

from __future__ import annotations

import random

TASKS = (
    "Explain {t} to a beginner in a few sentences.",
    "What are the three most important facts about {t}?",
    "Write a short paragraph about {t}.",
    "Give me a step-by-step guide related to {t}.",
    "What are common misconceptions about {t}?",
    "Summarize the history of {t} briefly.",
    "Write a short poem about {t}.",
    "List five questions a student might ask about {t}, with short answers.",
    "Compare {t} with something similar and explain the differences.",
    "How would you teach {t} to a ten-year-old?",
    "What are the pros and cons of {t}?",
    "Write an email to a friend recommending they learn about {t}.",
)
TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
    "healthy sleep habits", "compound interest", "the Python programming language", "volcanoes",
    "the immune system", "climate change", "the Roman Empire", "electric cars", "chess openings",
    "baking bread", "the theory of evolution", "recycling", "the stock market", "learning a new language",
    "the solar system", "sorting algorithms", "public speaking", "coffee", "the human heart",
    "renewable energy", "time management", "the printing press", "honeybees", "gardening",
    "prime numbers", "the internet", "meditation", "the Great Wall of China", "running a marathon",
    "cloud computing", "vitamins", "the moon landing", "jazz music", "earthquakes", "writing a resume",
)
CODE = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a JavaScript function that reverses an array without using reverse().",
    "Explain what a hash map is and show a small Python example.",
    "Write a SQL query that finds the top five customers by total order value.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Explain recursion with a short code example.",
    "Write a bash command that counts the lines of every .py file in a directory.",
)


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct user messages (all of them, shuffled, when n exceeds the set)."""
    prompts = [task.format(t=topic) for task in TASKS for topic in TOPICS] + list(CODE)
    random.Random(seed).shuffle(prompts)
    return prompts[:n]
