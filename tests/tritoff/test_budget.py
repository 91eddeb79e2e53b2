"""tritoff/budget.py: the default budget's headroom."""

from tritoff.budget import default_budget

GiB, MiB = 2**30, 2**20


def test_the_default_budget_leaves_five_percent_of_free_memory_and_at_least_512_mib():
    assert default_budget(80 * GiB) == 76 * GiB  # an idle H100: 4 GiB left for what the plan cannot count
    assert default_budget(8 * GiB) == 8 * GiB - 512 * MiB  # 5% would be 410 MiB: the floor holds
    assert default_budget(300 * MiB) == 0  # nothing fits: the planner names the smallest budget that works
