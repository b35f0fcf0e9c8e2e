from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from trainers.data.features import (
    Batch,
    FeatureDataset,
    FeatureError,
    FeatureSpec,
    collate_batch,
    trailing_run_length,
)
from trainers.data.manifest import Sample

DIM = 8
SPEC = FeatureSpec(model_dim=DIM, number_text_tokens=100, max_code=50)


def make_sample(folder: Path, index: int = 0, text=None, codes=None, condition=None, emo_vec=None, **overrides) -> Sample:
    """Save the given (or default valid) arrays and return a Sample pointing at them."""
    rng = np.random.default_rng(index)
    arrays = {
        "text": np.arange(2, 7, dtype=np.int32) if text is None else text,
        "codes": rng.integers(0, 50, size=9).astype(np.int32) if codes is None else codes,
        "cond": rng.standard_normal((32, DIM)).astype(np.float32) if condition is None else condition,
        "emo": rng.standard_normal(DIM).astype(np.float32) if emo_vec is None else emo_vec,
    }
    paths = {}
    for kind, array in arrays.items():
        path = folder / f"s{index}_{kind}.npy"
        np.save(path, array)
        paths[kind] = str(path)
    fields = dict(
        index=index,
        id=f"s{index}",
        source=f"manifest.jsonl:{index + 1}",
        text_ids_path=paths["text"],
        codes_path=paths["codes"],
        condition_path=paths["cond"],
        emo_vec_path=paths["emo"],
        text_len=int(np.asarray(arrays["text"]).shape[-1]),
        code_len=int(np.asarray(arrays["codes"]).shape[-1]),
        lang=None,
        speaker=None,
    )
    fields.update(overrides)
    return Sample(**fields)


def load_error(sample: Sample) -> str:
    with pytest.raises(FeatureError) as excinfo:
        FeatureDataset([sample], SPEC)[0]
    message = str(excinfo.value)
    assert message.startswith(f"{sample.source}: ")
    return message


def test_loads_arrays_with_expected_types_and_shapes(tmp_path):
    sample = make_sample(tmp_path, index=3)
    dataset = FeatureDataset([sample], SPEC)
    assert len(dataset) == 1
    item = dataset[0]
    assert item["index"] == 3 and item["id"] == "s3"
    assert item["text_ids"].dtype == torch.int64 and item["text_ids"].tolist() == [2, 3, 4, 5, 6]
    assert item["codes"].dtype == torch.int64 and item["codes"].shape == (9,)
    assert item["condition"].dtype == torch.float32 and item["condition"].shape == (32, DIM)
    assert item["emo_vec"].dtype == torch.float32 and item["emo_vec"].shape == (DIM,)
    np.testing.assert_array_equal(item["condition"].numpy(), np.load(sample.condition_path))


def test_accepts_leading_batch_axis_and_float16(tmp_path):
    sample = make_sample(
        tmp_path,
        codes=np.arange(9, dtype=np.int64)[None, :],
        condition=np.ones((1, 32, DIM), dtype=np.float16),
        emo_vec=np.ones((1, DIM), dtype=np.float32),
    )
    item = FeatureDataset([sample], SPEC)[0]
    assert item["codes"].tolist() == list(range(9))
    assert item["condition"].shape == (32, DIM) and item["condition"].dtype == torch.float32
    assert item["emo_vec"].shape == (DIM,)


def test_text_length_mismatch(tmp_path):
    message = load_error(make_sample(tmp_path, text_len=7))
    assert "text_ids" in message and str(tmp_path / "s0_text.npy") in message
    assert "has 5 ids" in message and "text_len 7" in message


def test_code_length_mismatch(tmp_path):
    message = load_error(make_sample(tmp_path, code_len=4))
    assert "codes" in message and "has 9 ids" in message and "code_len 4" in message


def test_text_ids_out_of_range_blames_tokenizer(tmp_path):
    message = load_error(make_sample(tmp_path, text=np.array([1, 2, 100], dtype=np.int32)))
    assert "100" in message and "tokenizer" in message


def test_codes_out_of_range(tmp_path):
    message = load_error(make_sample(tmp_path, codes=np.array([0, 50, 3], dtype=np.int32)))
    assert "50" in message and "[0, 50)" in message
    message = load_error(make_sample(tmp_path, codes=np.array([0, -1, 3], dtype=np.int32)))
    assert "-1" in message


def test_float_text_ids_rejected(tmp_path):
    message = load_error(make_sample(tmp_path, text=np.arange(5, dtype=np.float32)))
    assert "integer" in message and "float32" in message


def test_two_dimensional_text_ids_rejected(tmp_path):
    message = load_error(make_sample(tmp_path, text=np.zeros((2, 5), dtype=np.int32), text_len=5))
    assert "1-D" in message and "[2, 5]" in message


def test_wrong_condition_shape_names_expected_and_found(tmp_path):
    message = load_error(make_sample(tmp_path, condition=np.zeros((32, DIM + 1), dtype=np.float32)))
    assert "condition" in message and f"[32, {DIM}]" in message and f"[32, {DIM + 1}]" in message


def test_wrong_emo_vec_shape(tmp_path):
    message = load_error(make_sample(tmp_path, emo_vec=np.zeros((2, DIM), dtype=np.float32)))
    assert "emo_vec" in message and f"[{DIM}]" in message


def test_non_finite_values_rejected(tmp_path):
    condition = np.zeros((32, DIM), dtype=np.float32)
    condition[3, 1] = np.nan
    condition[4, 2] = np.inf
    message = load_error(make_sample(tmp_path, condition=condition))
    assert "condition" in message and "2 NaN/inf" in message


def test_unreadable_and_missing_files(tmp_path):
    sample = make_sample(tmp_path)
    Path(sample.codes_path).write_text("not an npy file")
    message = load_error(sample)
    assert "codes" in message and sample.codes_path in message

    sample = make_sample(tmp_path, index=1)
    Path(sample.emo_vec_path).unlink()
    assert "not found" in load_error(sample)


def test_pickled_object_arrays_are_refused(tmp_path):
    sample = make_sample(tmp_path)
    np.save(sample.text_ids_path, np.array([1, "a"], dtype=object), allow_pickle=True)
    assert "text_ids" in load_error(sample)


def test_trailing_run_length():
    assert trailing_run_length(np.array([1, 2, 2, 2])) == 3
    assert trailing_run_length(np.array([5, 5])) == 2
    assert trailing_run_length(np.array([1, 2])) == 1
    assert trailing_run_length(np.array([], dtype=np.int64)) == 0


def test_collate_pads_with_zeros(tmp_path):
    short = make_sample(tmp_path, index=0, text=np.array([5, 6], dtype=np.int32), codes=np.array([9, 8, 7], dtype=np.int32))
    long = make_sample(tmp_path, index=1, text=np.array([3, 4, 5, 6], dtype=np.int32), codes=np.array([1], dtype=np.int32))
    dataset = FeatureDataset([short, long], SPEC)
    batch = collate_batch([dataset[0], dataset[1]])
    assert isinstance(batch, Batch)
    assert batch.indices.tolist() == [0, 1] and batch.ids == ["s0", "s1"]
    assert batch.text_ids.tolist() == [[5, 6, 0, 0], [3, 4, 5, 6]]
    assert batch.text_lens.tolist() == [2, 4]
    assert batch.codes.tolist() == [[9, 8, 7], [1, 0, 0]]
    assert batch.code_lens.tolist() == [3, 1]
    for tensor in (batch.indices, batch.text_ids, batch.text_lens, batch.codes, batch.code_lens):
        assert tensor.dtype == torch.int64
    assert batch.condition.shape == (2, 32, DIM) and batch.condition.dtype == torch.float32
    assert batch.emo_vec.shape == (2, DIM) and batch.emo_vec.dtype == torch.float32
    torch.testing.assert_close(batch.condition[1], dataset[1]["condition"])


def test_collate_rejects_empty_list():
    with pytest.raises(ValueError):
        collate_batch([])


def test_batch_to_moves_tensors_and_keeps_ids(tmp_path):
    dataset = FeatureDataset([make_sample(tmp_path)], SPEC)
    batch = collate_batch([dataset[0]])
    moved = batch.to("cpu")
    assert moved.ids == batch.ids and moved.ids is not batch.ids
    assert torch.equal(moved.codes, batch.codes)
    assert moved.to(torch.device("meta")).condition.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_dataloader_pin_memory(tmp_path):
    samples = [make_sample(tmp_path, index=i) for i in range(3)]
    loader = DataLoader(FeatureDataset(samples, SPEC), batch_size=2, collate_fn=collate_batch, pin_memory=True)
    batch = next(iter(loader))
    assert isinstance(batch, Batch) and batch.codes.is_pinned() and batch.condition.is_pinned()
    assert batch.to("cuda", non_blocking=True).codes.device.type == "cuda"
