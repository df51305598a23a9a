"""Checkpoints: durable before `save` returns (the trainer COMMITs right after), and a step saved again never
leaves a moment with a half-deleted copy in place."""

from __future__ import annotations

import os
import shutil

import torch

from rlbus.trainer import checkpoint


def parts():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return model, optimizer, scheduler


def record_calls(monkeypatch) -> list[tuple[str, str]]:
    """(call, path) of every fsync, rename and rmtree, in order; each still does its work."""
    calls: list[tuple[str, str]] = []
    real_fsync, real_rename, real_rmtree = os.fsync, os.rename, shutil.rmtree

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst):
        calls.append(("rename", f"{src} -> {dst}"))
        return real_rename(src, dst)

    def rmtree(path, *args, **kwargs):
        calls.append(("rmtree", str(path)))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return calls


def test_a_checkpoint_is_synced_file_then_directory_then_rename_before_save_returns(tmp_path, monkeypatch):
    model, optimizer, scheduler = parts()
    root = tmp_path / "checkpoints"
    root.mkdir()
    calls = record_calls(monkeypatch)
    final = checkpoint.save(root, 3, 2, model, optimizer, scheduler)
    tmp = root / ".step_00000003.tmp"
    assert final == root / "step_00000003"
    durable = [c for c in calls if c[0] != "rmtree"]
    assert durable == [("fsync", str(tmp / "state.pt")), ("fsync", str(tmp)),
                       ("rename", f"{tmp} -> {final}"), ("fsync", str(root))]
    assert checkpoint.latest(root) == final
    restored = parts()
    with torch.no_grad():
        restored[0].weight.zero_()
    assert checkpoint.load(final, *restored) == (3, 2)
    assert torch.equal(restored[0].weight, model.weight)


def test_a_step_saved_again_sets_its_old_copy_aside_and_never_deletes_it_in_place(tmp_path, monkeypatch):
    model, optimizer, scheduler = parts()
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 3, 2, model, optimizer, scheduler)
    calls = record_calls(monkeypatch)
    final = checkpoint.save(root, 3, 5, model, optimizer, scheduler)
    assert ("rmtree", str(final)) not in calls, "the old copy was deleted where a restart would read it"
    stale = root / ".step_00000003.old"
    renames = [c[1] for c in calls if c[0] == "rename"]
    assert renames == [f"{final} -> {stale}", f"{root / '.step_00000003.tmp'} -> {final}"]
    into_place = calls.index(("rename", renames[-1]))
    assert ("fsync", str(root)) in calls[into_place + 1:], "the rename into place was not made durable"
    assert not stale.exists() and checkpoint.load(final, *parts()) == (3, 5)


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    model, optimizer, scheduler = parts()
    for step in (2, 4, 6):
        checkpoint.save(tmp_path, step, step, model, optimizer, scheduler, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004", "step_00000006"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step_00000006"
