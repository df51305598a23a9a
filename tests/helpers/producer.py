"""A producer process for crash tests: streams PUTs, records every ACKed id.

Usage: python -m tests.helpers.producer ADDRESS NAME GROUPS OUT_FILE
Each acknowledged id is appended to OUT_FILE only after its ACK arrived, so
the file is a lower bound on what the broker promised to keep.
"""

import sys

from rlbus.common.client import BrokerClient
from tests.conftest import group


def main() -> None:
    address, name, groups, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    client = BrokerClient(address, "explorer", name, heartbeat_interval_s=0.2, liveness=3, backoff_max_s=0.5)
    client.start(30)
    window = []
    with open(out, "a", buffering=1) as f:
        for i in range(groups):
            items = [(m, p * 64) for m, p in group(f"{name}-{i}", size=4)]
            window.append(client.put_async(items))
            if len(window) >= 4:
                done = window.pop(0).result(120)
                f.write("\n".join(done["stored"] + done["duplicate"]) + "\n")
        for fut in window:
            done = fut.result(120)
            f.write("\n".join(done["stored"] + done["duplicate"]) + "\n")
    client.close()


if __name__ == "__main__":
    main()
