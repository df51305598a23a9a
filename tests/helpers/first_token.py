"""A reward a tiny random model can learn in a few dozen steps: 1.0 when the first response token is in the
lower half of the vocabulary (SmolLM2's tokenizer: ids below 24,576). A fresh random model scores about 0.5."""

HALF = 49152 // 2


def score(task, response):
    ids = list(response.token_ids)
    return 1.0 if ids and ids[0] < HALF else 0.0
