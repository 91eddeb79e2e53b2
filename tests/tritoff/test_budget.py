"""tritoff/budget.py: sizes as users write them, and the default budget's headroom."""

import os

import pytest

from tritoff.budget import default_budget, format_bytes, parse_host_budget, parse_rate, parse_size

GiB, MiB = 2**30, 2**20


def test_the_default_budget_leaves_five_percent_of_free_memory_and_at_least_512_mib():
    assert default_budget(80 * GiB) == 76 * GiB  # an idle H100: 4 GiB left for what the plan cannot count
    assert default_budget(8 * GiB) == 8 * GiB - 512 * MiB  # 5% would be 410 MiB: the floor holds
    assert default_budget(300 * MiB) == 0  # nothing fits: the planner names the smallest budget that works


@pytest.mark.parametrize(
    "value, expected",
    [
        (12_000_000_000, 12 * 10**9),
        (1.5e9, 1_500_000_000),
        ("12GB", 12 * 10**9),
        ("12 GiB", 12 * GiB),
        ("12gib", 12 * GiB),
        (" 0.5 MiB ", MiB // 2),
        (".5GB", 5 * 10**8),
        ("2000000", 2_000_000),  # bytes, from 1 MiB up
        ("2.7B", 2),  # whole bytes, rounded down
        ("1e9", 10**9),  # what Python prints for 1e9
        ("2.5E3 MB", 2_500_000_000),
        (2**63 - 1, 2**63 - 1),  # the largest size taken
        ("25%", GiB),
    ],
    ids=str,
)
def test_sizes_in_every_spelling(value, expected):
    assert parse_size(value, total=4 * GiB) == expected


@pytest.mark.parametrize(
    "value, message",
    [
        ("abc", "invalid budget 'abc': give bytes"),
        ("12 GBs", "invalid budget '12 GBs': give bytes"),
        ("-1GB", "invalid budget '-1GB': give bytes"),
        ("0GB", "it must be positive"),
        (0, "it must be positive"),
        (True, "invalid budget True"),
        (float("nan"), "give a finite number"),
        ("1e999", "give a finite number"),
        ("1e308GB", "give a finite number"),
        pytest.param(10**400, "invalid budget of 401 characters: more than 2\\*\\*63", id="10**400"),  # over a float
        (2**63, "invalid budget 9223372036854775808: more than 2\\*\\*63 bytes"),
        ("10000PB", "invalid budget '10000PB': give bytes"),
        ("1e10TB", "more than 2\\*\\*63 bytes, more than any machine has"),
        ("12e", "invalid budget '12e': give bytes"),
        ("120%", "at most 100%"),
        (0.5, "less than one byte; give a unit"),
        ("12", "invalid budget '12': a number without a unit is bytes; give a unit, e.g. '12GB'"),  # 12GB meant
        ("1048575", "a number without a unit is bytes"),
        ("0.0001KB", "less than one byte"),
        ("0.00000001%", "less than one byte"),
    ],
    ids=str,
)
def test_a_bad_size_is_refused_in_one_line_that_says_what_to_give(value, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_size(value, total=4 * GiB)
    assert "\n" not in str(info.value)


def test_a_percentage_needs_memory_to_take_it_of():
    with pytest.raises(ValueError, match="is a percentage, but there is no GPU memory to take it of; give bytes"):
        parse_size("80%")
    # where none is taken (a plan: no GPU to take it of), the error says so whatever the machine
    with pytest.raises(ValueError, match=r"^invalid budget '80%': give bytes \(e.g. '12GB'\), not a percentage$"):
        parse_size("80%", total=4 * GiB, percent=False)


@pytest.mark.parametrize("value", ["25GB", "25GB/s", " 25 GB/s ", "25gb/S", 25 * 10**9], ids=str)
def test_a_rate_is_bytes_per_second_with_or_without_its_per_second(value):
    assert parse_rate(value, "link") == 25 * 10**9


@pytest.mark.parametrize("value", ["25GB/h", "25%/s", "/s", "50%"], ids=str)
def test_a_rate_in_other_units_is_refused(value):
    with pytest.raises(ValueError, match="invalid link"):
        parse_rate(value, "link")


@pytest.mark.parametrize("zero", [0, 0.0, "0", "0GB", "0 MiB", "0%"], ids=str)
def test_a_host_budget_of_zero_in_any_spelling_serves_every_pack_from_disk(zero):
    assert parse_host_budget(zero) == 0


def test_no_host_budget_holds_every_pack_and_a_size_is_a_size():
    assert parse_host_budget(None) is None
    assert parse_host_budget("3GiB") == 3 * GiB
    with pytest.raises(ValueError, match="invalid host_budget 'lots'"):
        parse_host_budget("lots")


def test_a_cgroup_memory_limit_bounds_what_a_percentage_of_host_memory_is(tmp_path, monkeypatch):
    from tritoff import budget

    # v2: one hierarchy, a limit on an ancestor of the process's cgroup, "max" (none) on the cgroup itself
    (tmp_path / "v2" / "docker" / "abc").mkdir(parents=True)
    (tmp_path / "v2" / "docker" / "memory.max").write_text("2147483648\n")
    (tmp_path / "v2" / "docker" / "abc" / "memory.max").write_text("max\n")
    (tmp_path / "proc2").write_text("0::/docker/abc\n")
    assert budget.cgroup_memory_limits(tmp_path / "proc2", tmp_path / "v2") == [2**31]
    # v1: the memory controller's own hierarchy; the other controllers' lines are not about memory
    (tmp_path / "v1" / "memory" / "slice").mkdir(parents=True)
    (tmp_path / "v1" / "memory" / "slice" / "memory.limit_in_bytes").write_text("1073741824\n")
    (tmp_path / "v1" / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "proc1").write_text("12:cpu,cpuacct:/slice\n4:memory:/slice\n")
    assert budget.cgroup_memory_limits(tmp_path / "proc1", tmp_path / "v1") == [2**30, 9223372036854771712]
    assert budget.cgroup_memory_limits(tmp_path / "none", tmp_path / "v1") == []  # no cgroups: the RAM alone
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert ram > 2**30
    monkeypatch.setattr(budget, "cgroup_memory_limits", lambda: [2**30, 9223372036854771712])
    assert budget.host_memory() == 2**30
    assert budget.parse_host_budget("50%") == 2**29
    monkeypatch.setattr(budget, "cgroup_memory_limits", lambda: [])
    assert budget.parse_host_budget("50%") == ram // 2


def test_a_smallest_budget_is_shown_rounded_up_so_that_given_back_it_is_enough():
    # 116177 B is 113.454 KiB: "113.45 KiB" given back as a budget would be 5 bytes short
    assert format_bytes(116177) == "113.45 KiB" and format_bytes(116177, up=True) == "113.46 KiB"
    assert format_bytes(20 * 2**20, up=True) == "20.00 MiB" and format_bytes(1023.5, up=True) == "1024 B"
    import random

    rng = random.Random(0)
    for n in [rng.randrange(1, 2**45) for _ in range(2000)] + [2**k + d for k in range(10, 45) for d in (-1, 0, 1)]:
        shown = format_bytes(n, up=True)
        step = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 100}[shown.split()[1]] / 100  # one in the last digit
        assert n <= parse_size(shown.replace(" ", "")) < n + step + 1, (n, shown)
