"""tritoff/fingerprint.py: a config only another library version writes differently is the same model; any value
both configs hold with another value is not, and is named by its path."""

import json

import pytest
import torch

from tritoff.fingerprint import (
    config_differences,
    config_refusal,
    fingerprint,
    json_data,
    matches_store,
    recorded_parts,
)


class Configured(torch.nn.Module):
    """A module with a config and one weight."""

    def __init__(self, config: dict, width: int = 4):
        super().__init__()
        self.config = config
        self.proj = torch.nn.Linear(width, width)


def _stored(module) -> dict:
    """The index entry a store records for ``module``, read back from JSON as a store's index is."""
    made = fingerprint(module)
    return json.loads(json.dumps({"fingerprint": made, **recorded_parts(made)}))


def test_keys_one_side_lacks_at_any_depth_are_no_difference():
    stored = {"num_layers": 2, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}}
    made = {"num_layers": 2, "rope_parameters": {"rope_theta": 1e4, "factor": 8.0}, "new_argument": True}
    assert config_differences(stored, made) == []


def test_a_value_both_hold_differently_is_named_by_its_path():
    stored = {"rope_parameters": {"rope_theta": 1e4}, "latents_mean": [0.0, 0.5, -1.0], "eps": 1e-6}
    made = {"rope_parameters": {"rope_theta": 1e6}, "latents_mean": [0.0, 0.5, -2.0], "eps": 1e-6}
    assert config_differences(stored, made) == [
        "latents_mean[2] (-1.0 in the store, -2.0 here)",
        "rope_parameters.rope_theta (10000.0 in the store, 1000000.0 here)",
    ]
    # lists of other lengths are named whole
    assert config_differences({"a": [1, 2]}, {"a": [1, 2, 3]}) == ["a ([1, 2] in the store, [1, 2, 3] here)"]


@pytest.mark.parametrize(
    "stored, made, same",
    [
        (1, 1.0, True),  # a default written as a float by another release
        (True, 1, False),  # a flag is not a count
        (False, 0.0, False),
        (None, 0, False),
        ("1", 1, False),
    ],
)
def test_numbers_compare_by_value_and_flags_by_type(stored, made, same):
    assert (config_differences({"key": stored}, {"key": made}) == []) == same


def test_json_data_is_strict_json_that_compares_as_the_config_does():
    data = json_data({"shape": (1, 2), "dtype": torch.bfloat16, "eps": float("nan"), 3: float("-inf"), "n": None})
    assert data == {"shape": [1, 2], "dtype": "torch.bfloat16", "eps": "nan", "3": "-inf", "n": None}
    json.dumps(data, allow_nan=False)  # no bare NaN or Infinity in a store's index
    assert config_differences(data, json_data({"eps": float("nan")})) == []  # a NaN equals itself


def test_a_refusal_stays_on_one_line_and_counts_what_it_does_not_name():
    keys = config_differences({f"k{i}": i for i in range(5)} | {"odd\nkey": 1}, {f"k{i}": -i for i in range(5)})
    keys += config_differences({"odd\nkey": 1}, {"odd\nkey": 2})
    text = config_refusal(keys)
    assert "\n" not in text and text.endswith("; 2 more") and text.startswith("k1 (1 in the store, -1 here)")
    assert config_refusal(keys[:1]) == "k1 (1 in the store, -1 here)"


def test_a_module_matches_its_store_entry_across_library_versions():
    module = Configured({"width": 4, "rope": {"theta": 10000}})
    entry = _stored(module)
    assert matches_store(entry, fingerprint(module))
    # a later release records a new argument, and a new key in a nested one: another fingerprint, the same model
    later = Configured({"width": 4, "rope": {"theta": 10000, "type": "default"}, "new_argument": 0})
    assert fingerprint(later) != entry["fingerprint"] and matches_store(entry, fingerprint(later))
    # a value both hold differs: another model
    assert not matches_store(entry, fingerprint(Configured({"width": 4, "rope": {"theta": 500000}})))
    # other parameters, or another class of the same parameters, under the same config
    assert not matches_store(entry, fingerprint(Configured({"width": 4, "rope": {"theta": 10000}}, width=8)))

    class Other(Configured):
        pass

    assert not matches_store(entry, fingerprint(Other({"width": 4, "rope": {"theta": 10000}})))
    # a store that recorded no config (written before stores did) matches its fingerprint alone
    unrecorded = {"fingerprint": entry["fingerprint"]}
    assert matches_store(unrecorded, fingerprint(module)) and not matches_store(unrecorded, fingerprint(later))


def test_a_config_with_keys_of_several_types_is_fingerprinted():
    made = fingerprint(Configured({"names": {1: "a", "b": 2}}))
    assert made.config == {"names": {"1": "a", "b": 2}} and len(made) == 64
