"""A reward plugin for worker tests: takes `task["sleep"]` seconds, then checks exact equality."""

import time


def score(task, response):
    time.sleep(float(task.get("sleep", 0)))
    return 1.0 if response.text == task["answer"] else 0.0
