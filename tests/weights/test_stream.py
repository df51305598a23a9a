"""An engine reloading from a fetch still in progress (weights/stream.py), with a real weight server on loopback.

The engine here is a stand-in that runs the workers' side (`open_source`) in a thread of the test; the real
vLLM engine reloads the same way in tests/test_hosts.py, where every version comes by fetch.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zstandard")
from safetensors.torch import load_file  # noqa: E402

from rlbus.weights.fetch import SPARE, fetch_version  # noqa: E402
from rlbus.weights.stream import StreamFailed, StreamProgress, streamed_tensors  # noqa: E402
from rlbus.weights.sync import Receiver, checkpoint_source, open_source  # noqa: E402
from tests.helpers.served import state_of  # noqa: E402


def same_tensors(got: dict, path) -> bool:
    want = load_file(str(path / "model.safetensors"))
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_reload_takes_each_tensor_once_its_chunks_are_in_and_never_reads_ahead(served, tmp_path):
    server, root, digests = served
    dest = tmp_path / "fetched"
    # The work file starts as an older version's bytes (the spare a fetch writes over): a reader that ran ahead of
    # the chunks would take v1's values where v3's belong.
    shutil.copytree(root / "v1", dest / SPARE)
    progress = StreamProgress(tmp_path / "v3.stream")
    got, info, errors = {}, {}, []

    def worker():
        try:
            for name, tensor in streamed_tensors(progress.path, 10.0, info):
                got[name] = tensor.clone()
        except Exception as exc:
            errors.append(exc)

    reader = threading.Thread(target=worker)
    reader.start()
    time.sleep(0.05)  # the reader waits for a progress file that is not there yet
    states = []

    def slow(done, total):  # chunks land one at a time, the reader is always waiting on the next
        time.sleep(0.05)
        states.append(len(got))

    fetched = fetch_version(server.address, 3, digests[3], dest, None, on_chunk=slow, progress=progress)
    reader.join(10)
    assert not errors and not reader.is_alive()
    assert same_tensors(got, fetched.path)
    assert info["tensors"] == 3 and info["stream_wait_s"] > 0
    # Tensors were handed out while chunks were still arriving, not all at the end.
    assert any(0 < n < 3 for n in states[:-1]), states


def test_a_version_already_fetched_is_read_where_it_lies(served, tmp_path):
    server, root, digests = served
    fetch_version(server.address, 2, digests[2], tmp_path / "f")
    progress = StreamProgress(tmp_path / "v2.stream")
    fetch_version(server.address, 2, digests[2], tmp_path / "f", progress=progress)  # nothing to fetch
    info: dict = {}
    assert same_tensors(dict(streamed_tensors(progress.path, 5.0, info)), root / "v2")


def test_a_failed_or_stalled_fetch_stops_the_reload(served, tmp_path):
    server, root, digests = served
    failed = StreamProgress(tmp_path / "failed.stream")
    failed.fail("FetchFailed: the weight server went away")
    with pytest.raises(StreamFailed, match="went away"):
        list(streamed_tensors(failed.path, 5.0, {}))
    # Started, then nothing more: the reader gives up after its timeout instead of waiting for ever.
    stalled = StreamProgress(tmp_path / "stalled.stream")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "model.safetensors").write_bytes(b"\0" * 1024)
    stalled.start(tmp_path / "work", [{"name": "model.safetensors", "size": 1024, "chunks": [1]}], 1024, [(0, 0)])
    started = time.monotonic()
    with pytest.raises(StreamFailed, match="no progress"):
        list(streamed_tensors(stalled.path, 0.3, {}))
    assert time.monotonic() - started < 5


class StreamingEngine:
    """A stand-in for the vLLM engine that reloads as its workers do: from `open_source`'s tensors."""

    overlaps_fetch = True

    def __init__(self):
        self.version = 0
        self.sources: list[dict] = []
        self.weights: dict = {}

    def reload(self, source: dict, version: int) -> dict:
        self.sources.append(source)
        tensors, info = open_source(source, None)
        self.weights = {name: tensor.clone() for name, tensor in tensors}
        self.version = version
        return info


def test_the_receiver_reloads_while_it_fetches_from_the_second_version_on(served, tmp_path):
    server, root, digests = served
    engine, receiver = StreamingEngine(), Receiver("e", tmp_path / "fetched", mode="fetch")
    assert receiver.load(engine, state_of(server, root, digests, 1))
    # The first version has nothing to go back to if its fetch fails: fetched, then reloaded from the files.
    assert engine.sources[-1] == checkpoint_source(tmp_path / "fetched" / "v1")
    for version in (2, 3):  # a delta (ready once applied), then a whole version (chunk by chunk)
        if version == 3:
            server.deltas = False
        assert receiver.load(engine, state_of(server, root, digests, version))
        assert engine.sources[-1]["method"] == "stream" and engine.version == version
        assert same_tensors(engine.weights, root / f"v{version}")
    assert not list((tmp_path / "fetched").glob("*.stream*"))
    # Off: fetched first, then reloaded.
    engine2, plain = StreamingEngine(), Receiver("e2", tmp_path / "f2", mode="fetch", overlap=False)
    for version in (1, 2):
        assert plain.load(engine2, state_of(server, root, digests, version))
    assert [s["method"] for s in engine2.sources] == ["checkpoint", "checkpoint"]


def test_a_fetch_that_fails_under_the_reload_puts_the_engine_back_on_the_version_it_held(served, tmp_path):
    server, root, digests = served
    engine, receiver = StreamingEngine(), Receiver("e", tmp_path / "fetched", mode="fetch", fetch_timeout_s=1.0)
    assert receiver.load(engine, state_of(server, root, digests, 1))
    # The bus announces v2 with a digest the server's v2 does not have: the fetch fails after the reload began.
    wrong = {**state_of(server, root, digests, 2), "digest": digests[3]}
    assert not receiver.load(engine, wrong)
    assert [s["method"] for s in engine.sources] == ["checkpoint", "stream", "checkpoint"]
    assert engine.version == 1 and same_tensors(engine.weights, root / "v1")
    assert receiver.held.version == 1
