"""A reward plugin for worker tests: takes `task["sleep"]` seconds, then checks exact equality (or returns
`task["give"]`, whatever it is)."""

import time


def score(task, response):
    if "give" in task:  # whatever the task says, number or not
        return task["give"]
    time.sleep(float(task.get("sleep", 0)))
    return 1.0 if response.text == task["answer"] else 0.0
