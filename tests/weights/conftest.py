"""The weight server over three published versions of a small model, in a thread of the test."""

from __future__ import annotations

import pytest


@pytest.fixture
def served(tmp_path, request):
    """A weight server over three published versions; parametrize indirectly with True to map its files."""
    pytest.importorskip("zstandard")
    from rlbus.weights.server import WeightServer
    from tests.helpers.served import CHUNK_BYTES, publish_versions

    root = tmp_path / "served"
    digests = publish_versions(root, 3)
    server = WeightServer(root, chunk_bytes=CHUNK_BYTES, map_files=getattr(request, "param", False)).start()
    yield server, root, digests
    server.close()


@pytest.fixture
def dealer(served):
    """A DEALER socket connected to the `served` weight server."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(served[0].address)
    yield sock
    sock.close(0)
