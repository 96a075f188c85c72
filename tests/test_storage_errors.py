"""`slime.storage_errors`: a full, over-quota or read-only filesystem recognised in whatever exception reaches the
driver (directly, chained, wrapped by Ray, or only in a remote traceback's text) and told in one line."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.exceptions import RayTaskError

from slime import storage_errors
from slime.observability import logging_utils
from slime.storage_errors import (
    StorageFault,
    StorageWriteError,
    fault_message,
    find_storage_fault,
    storage_fault,
    with_context,
)

RESUME = (
    "rerun the same command: it resumes from its last joint commit (`slime-run runs {save}` shows which step that is)"
)


def _raised(exc: BaseException) -> BaseException:
    """`exc` as it is after a real raise (with its traceback)."""
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - returned to the test
        return caught


def _remote(exc: BaseException, method: str) -> BaseException:
    """What the driver's `ray.get` raises when actor method `method` ("Class.name") raised `exc`: Ray's own
    RayTaskError, built from the real traceback, pickled in transit, and turned into the dual-class instance."""
    raised = _raised(exc)
    traceback_str = "".join(traceback.format_exception(raised))
    cause = pickle.loads(pickle.dumps(raised))
    error = RayTaskError(method, traceback_str, cause, proctitle=f"ray::{method}", pid=1234, ip="127.0.0.1")
    return error.as_instanceof_cause()


@pytest.mark.parametrize(
    ("number", "reason", "remedy"),
    [
        (errno.ENOSPC, "no space left on device", "free space on that filesystem"),
        (errno.EDQUOT, "disk quota exceeded", "free space within your quota on that filesystem (or have it raised)"),
        (errno.EROFS, "read-only file system", "make that filesystem writable again (remount it read-write)"),
    ],
)
def test_each_storage_errno_is_recognised_and_its_file_named(tmp_path, number, reason, remedy):
    save = tmp_path / "run"
    target = save / "metrics.jsonl"
    error = _raised(OSError(number, os.strerror(number), str(target)))
    assert isinstance(error, OSError) and error.errno == number  # a real OSError subclass for that errno
    fault = find_storage_fault(error)
    assert fault == StorageFault(number, str(target), None, None)
    message = fault_message(fault, save=str(save), pool=str(save / "rollout_data"))
    assert message == f"{reason} while writing {target}; {remedy} and {RESUME.format(save=save)}"


def test_a_real_enospc_without_a_filename_names_the_save_directory(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux) for a real ENOSPC")
    with open("/dev/full", "wb", buffering=0) as full, pytest.raises(OSError) as caught:
        full.write(b"x")
    assert caught.value.errno == errno.ENOSPC and caught.value.filename is None
    save = tmp_path / "run"
    fault = storage_fault(caught.value, (str(save), str(save / "rollout_data")))
    assert fault is not None and fault.errno == errno.ENOSPC and fault.filename is None
    assert fault_message(fault, save=str(save), pool=str(save / "rollout_data")) == (
        f"no space left on device while writing on the filesystem holding {save}; free space on that filesystem "
        f"and {RESUME.format(save=save)}"
    )


def test_other_errors_are_not_storage_faults(tmp_path):
    for error in (
        FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(tmp_path / "missing")),
        PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path)),
        OSError("disk full"),  # no errno: nothing says which fault
        RuntimeError("saving /x/iter_0000001 failed: boom"),
        ValueError("Missing queue_state checkpoint"),
    ):
        assert find_storage_fault(_raised(error)) is None
        assert storage_fault(_raised(error), (str(tmp_path),)) is None  # tmp_path's filesystem is writable


def test_a_fault_is_found_through_cause_and_context_and_a_relative_filename_is_dropped(tmp_path):
    try:
        try:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), "chat_template.jinja")  # as shutil.rmtree reports
        except OSError:
            raise RuntimeError("cleanup failed") from None  # context only, cause suppressed
    except RuntimeError as outer:
        error = outer
    wrapped = _raised(ValueError("step failed"))
    wrapped.__cause__ = error
    fault = find_storage_fault(wrapped)
    assert fault == StorageFault(errno.EROFS, None, None, None)
    save = tmp_path / "run"
    assert fault_message(fault, save=str(save)) == (
        f"read-only file system while writing on the filesystem holding {save}; make that filesystem writable again "
        f"(remount it read-write) and {RESUME.format(save=save)}"
    )


def test_the_driver_function_that_wrote_names_the_operation(tmp_path):
    def commit_checkpoint():  # the name of slime.data.checkpoint's function: the traceback carries it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "run/rollout/committed_3.partial"))

    with pytest.raises(OSError) as caught:
        commit_checkpoint()
    fault = find_storage_fault(caught.value)
    assert fault.operation == "committing the joint checkpoint"
    assert fault_message(fault, save=str(tmp_path / "run")).startswith(
        f"no space left on device while committing the joint checkpoint, writing {tmp_path}/run/rollout/"
        "committed_3.partial; free space on that filesystem and rerun the same command"
    )


def test_a_ray_wrapped_storage_write_error_keeps_its_operation_and_actor(tmp_path):
    save = tmp_path / "run"
    iter_dir = save / "iter_0000003"
    original = _raised(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 205312 vs 205204"))
    try:
        raise StorageWriteError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(iter_dir), "saving the model checkpoint")
    except OSError as exc:
        exc.__cause__ = original
        stored = exc
    error = _remote(stored, "TorchTrainRayActor.save_model")
    assert isinstance(error, OSError) and isinstance(error, RayTaskError)  # Ray's dual-class wrapper
    assert error.cause.operation == "saving the model checkpoint"
    fault = find_storage_fault(error)
    assert fault == StorageFault(
        errno.ENOSPC, str(iter_dir), "saving the model checkpoint", "TorchTrainRayActor.save_model"
    )
    assert fault_message(fault, save=str(save), pool=str(save / "rollout_data")) == (
        f"no space left on device while saving the model checkpoint (TorchTrainRayActor.save_model), writing "
        f"{iter_dir}; free space on that filesystem and {RESUME.format(save=save)}"
    )


def test_a_fault_seen_only_in_a_remote_traceback_names_the_pool_for_a_pool_write(tmp_path):
    from straw.errors import QuotaExceeded  # straw's pool error: a RuntimeError carrying Rust's io::Error text

    error = _remote(QuotaExceeded("No space left on device (os error 28)"), "RolloutManager.generate")
    assert not isinstance(error, OSError)
    save, pool = tmp_path / "run", tmp_path / "run" / "rollout_data"
    fault = find_storage_fault(error)
    assert fault == StorageFault(errno.ENOSPC, None, "storing a rollout in the straw pool", "RolloutManager.generate")
    assert fault_message(fault, save=str(save), pool=str(pool)) == (
        "no space left on device while storing a rollout in the straw pool (RolloutManager.generate), on the "
        f"filesystem holding {pool}; free space on that filesystem and {RESUME.format(save=save)}"
    )


def test_a_python_errno_in_a_remote_traceback_gives_errno_and_file(tmp_path):
    target = tmp_path / "run" / "rollout" / "queue_state_4.json"
    inner = _raised(OSError(errno.EROFS, os.strerror(errno.EROFS), str(target)))
    try:
        raise RuntimeError("save failed") from inner
    except RuntimeError as exc:
        wrapped = exc
    error = _remote(wrapped, "RolloutManager.save")
    fault = find_storage_fault(error)
    assert fault == StorageFault(
        errno.EROFS, str(target), "saving the rollout queue and batch-builder state", "RolloutManager.save"
    )


def test_storage_write_error_pickles_with_its_operation():
    error = StorageWriteError(errno.EROFS, os.strerror(errno.EROFS), "/save/weights", "exporting the new weights")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.errno, copy.filename, copy.operation) == (errno.EROFS, "/save/weights", "exporting the new weights")
    assert str(copy) == "[Errno 30] Read-only file system: '/save/weights'"


def _statvfs(flag: int, available_blocks: int):
    """A filesystem's `os.statvfs` answer: its flags and the blocks available (of 4 KiB)."""
    return lambda path: SimpleNamespace(f_flag=flag, f_bavail=available_blocks, f_frsize=4096)


def test_with_context_finds_the_errno_or_asks_the_filesystem(tmp_path, monkeypatch):
    target = tmp_path / "iter_0000002"
    chained = _raised(RuntimeError("unexpected pos 704 vs 598"))
    chained.__context__ = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # torch.save to a Python file object
    error = with_context(chained, target, "saving the model checkpoint")
    assert isinstance(error, StorageWriteError)
    assert (error.errno, error.filename, error.operation) == (errno.ENOSPC, str(target), "saving the model checkpoint")

    bare = _raised(RuntimeError("basic_ios::clear: iostream error"))  # torch.save to a path: no errno at all
    assert with_context(bare, target, "saving the model checkpoint") is None  # tmp_path has room and is writable
    monkeypatch.setattr(storage_errors.os, "statvfs", _statvfs(os.ST_RDONLY, 10**6))
    assert with_context(bare, target, "saving").errno == errno.EROFS
    assert with_context(bare, target, "saving", probe=False) is None
    monkeypatch.setattr(storage_errors.os, "statvfs", _statvfs(0, 0))
    assert with_context(bare, target, "saving").errno == errno.ENOSPC
    fault = storage_fault(_remote(bare, "TorchTrainRayActor.update_weights"), (str(tmp_path),))
    assert fault == StorageFault(
        errno.ENOSPC, None, "exporting the new weights for the engines", "TorchTrainRayActor.update_weights"
    )


def test_a_metrics_line_that_could_not_be_written_does_not_fail_the_close(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (Linux) for a real ENOSPC")
    args = SimpleNamespace(metrics_dir=str(tmp_path), save=None)
    path = logging_utils.metrics_path(args)
    logging_utils._files[str(path)] = open("/dev/full", "a", encoding="utf-8")  # a full disk under the metrics file
    with pytest.raises(OSError) as caught:
        logging_utils.log_metrics(args, 3, {"rollout/reward": 0.5})
    assert caught.value.errno == errno.ENOSPC
    fault = find_storage_fault(caught.value)
    assert fault is not None and fault.operation == "writing the run's metrics"
    logging_utils.finish_tracking(args)  # the line still buffered cannot be written: dropped, not raised again
    assert str(path) not in logging_utils._files
    assert not Path(path).exists()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs under `tmp_path` (skips where mounting is not permitted), always unmounted."""
    path = tmp_path / "disk"
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs is not permitted here: not root (needs CAP_SYS_ADMIN)")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root or CAP_SYS_ADMIN): {mounted.stderr}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True, check=True)


def _fill(directory: Path) -> Path:
    """Write a file into `directory` until its filesystem has no space left; the file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as stream:
        try:
            while True:
                stream.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_commit_the_filesystem_refuses_leaves_no_marker_and_a_later_commit_succeeds(small_tmpfs, fault):
    from test_checkpoint import _restore, _step

    from slime.data.checkpoint import commit_checkpoint, committed_steps, resolve_checkpoint

    root, pool = small_tmpfs / "run", small_tmpfs / "run" / "rollout_data"
    _step(root, 0, pool)
    _step(root, 1, pool, commit=False)  # every component of step 1 durable: only the marker is left to write
    args = SimpleNamespace(save=str(root), rollout_data_dir=str(pool), rollout_queue_run_id="rollout")
    filler = _fill(small_tmpfs) if fault == "full" else None
    if fault == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    marker = root / "rollout" / "committed_1.json"
    with pytest.raises(StorageWriteError) as caught:
        commit_checkpoint(args, 1, model_args=[args])
    number = errno.ENOSPC if fault == "full" else errno.EROFS
    assert (caught.value.errno, caught.value.filename) == (number, str(marker))
    fault_found = find_storage_fault(caught.value)
    assert fault_found == StorageFault(number, str(marker), "committing the joint checkpoint", None)
    # Nothing a later run could take for a commit of step 1: selection resumes from step 0.
    assert not marker.exists() and committed_steps(root) == [0]
    restore = _restore(root, small_tmpfs / "next", rollout_queue_run_id="rollout")
    _, plan = resolve_checkpoint(restore)
    assert plan.mode == "snapshot" and restore.ckpt_step == 0 and restore.start_rollout_id == 1

    if filler is not None:
        filler.unlink()
    else:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], check=True)
    commit_checkpoint(args, 1, model_args=[args])  # what a torn marker write left does not stand in the way
    assert committed_steps(root) == [0, 1] and json.loads(marker.read_text())["rollout_id"] == 1
