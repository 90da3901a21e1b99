"""A dense reward for a task model at chance (the quick demo, `python examples/demo.py --quick`, and
the README's tiny MoE loop): the share of the answer's characters the response has in the same place.

The demo's own reward, `exact`, is 1 only for a whole right answer, and a model a few warm-start
steps old writes none: every group of a step would have equal rewards (all 0), every advantage
would be 0 and the step would train on nothing. Credit for each right character tells a group's
samples apart from the first step, so that BAPO's updates have something to follow.
"""


def right_characters(text: str, ids: list[int], record: dict) -> float:
    """Right characters in place over the longer of the answer and the response (a response that
    runs on past the answer loses credit; only the answer itself scores 1)."""
    answer, response = str(record["answer"]).strip(), text.strip()
    right = sum(a == b for a, b in zip(answer, response, strict=False))  # lengths differ: the rest is wrong
    return right / max(len(answer), len(response), 1)
