"""The straw data path's typed records: a Sample's queue bookkeeping and the transport's settings."""

from __future__ import annotations

from dataclasses import fields

from slime.data import queue_state
from slime.data.queue_state import ATTRIBUTES, LIVE_FIELDS, QueueState
from slime.utils.types import Sample


def test_record_and_attribute_table_name_the_same_fields():
    assert {field.name for field in fields(QueueState)} == set(ATTRIBUTES)
    assert set(LIVE_FIELDS) <= set(ATTRIBUTES)


def test_stamp_read_copy_and_clear_live():
    sample = Sample(index=3)
    assert QueueState.of(sample) == QueueState()
    queue_state.stamp(sample, lease={"task_id": "prompt:3", "attempt_id": "a"}, branch="b", source_positions=[7])
    state = QueueState.of(sample)
    assert state.task_id == "prompt:3" and state.position is None and state.branch == "b"
    queue_state.stamp(sample, receipt={"position": 12, "task_id": "prompt:3"})
    assert QueueState.of(sample).position == 12
    produced = Sample(index=4)
    queue_state.copy_state(sample, produced)
    assert QueueState.of(produced) == QueueState.of(sample)
    queue_state.clear_live(produced)
    cleared = QueueState.of(produced)
    assert cleared.lease is None and cleared.receipt is None and cleared.source_positions is None
    assert cleared.branch == "b"  # provenance stays
    assert QueueState.of(sample).lease is not None  # the source is untouched


def test_straw_settings_defaults_and_bad_values():
    from types import SimpleNamespace

    import pytest

    from slime.data.straw_settings import StrawSettings

    settings = StrawSettings.from_args(SimpleNamespace())
    assert (settings.run_id, settings.lease_seconds, settings.io_concurrency, settings.compression) == (
        "rollout",
        300,
        16,
        None,
    )
    assert StrawSettings.from_args(SimpleNamespace(rollout_data_compression="zstd")).compression == "zstd"
    with pytest.raises(ValueError, match="--rollout-data-compression 'lz4'"):
        StrawSettings.from_args(SimpleNamespace(rollout_data_compression="lz4"))
    with pytest.raises(ValueError, match="--rollout-queue-lease-seconds must be at least 3, got 1"):
        StrawSettings.from_args(SimpleNamespace(rollout_queue_lease_seconds=1))
    with pytest.raises(ValueError, match="--rollout-io-concurrency must be at least 1, got 0"):
        StrawSettings.from_args(SimpleNamespace(rollout_io_concurrency=0))
