"""A toy reward for the tiny online example: the share of even token ids in the response.

A random tiny model emits about half even ids; RL raises the share, which shows the whole loop
(generation, reward, BAPO update, weight sync) learning in a minute on a CPU. A reward function
takes (response text, response token ids, the prompt's data record) and returns a float.
"""


def even_share(text: str, ids: list[int], record: dict) -> float:
    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))
