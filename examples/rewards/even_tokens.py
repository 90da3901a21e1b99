"""A toy reward for the tiny online example: the share of even token ids in the response.

A random tiny model emits about half even ids; the share rises slowly under RL (measured on
2 CPU cores: from about 0.49 in the first steps to about 0.54 at step 20), enough to see the
whole loop (generation, reward, BAPO update, weight sync) at work in a minute. The demo that
learns a real task is issue 16's. A reward function
takes (response text, response token ids, the prompt's data record) and returns a float.
"""


def even_share(text: str, ids: list[int], record: dict) -> float:
    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))
