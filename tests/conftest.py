"""What the whole suite shares: the lessons' multi-rank paths listed in tests/nccl_rule_paths.py
run under NCCL's ordering rule, so a path that would deadlock on a GPU node fails here."""

import pytest

from nccl_rule_paths import UNDER_RULE


@pytest.fixture(autouse=True)
def _under_nccls_rule_where_listed(request, monkeypatch):
    test = f"tests/{request.node.path.name}::{getattr(request.node, 'originalname', request.node.name)}"
    if test in UNDER_RULE:
        monkeypatch.setenv("PIPELAB_NCCL_RULE", "1")
