"""parallel/rank_link.py's `BatchEnds`: a serving rank's account of rank 0's batch ends, shared by
CFG-parallel's rank 1 (`Follower`) and the sequence-parallel followers (`SequenceFollower`)."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_omni_like.parallel.cfg_parallel import Follower
from vllm_omni_like.parallel.rank_link import BatchEnds
from vllm_omni_like.parallel.sequence_parallel import SequenceFollower


class ScriptedLink:
    """Rank 0's side of a link, as the messages it sent, in order."""

    def __init__(self, *messages: Any) -> None:
        self.messages = list(messages)

    def recv_obj(self) -> Any:
        return self.messages.pop(0)


def test_an_end_of_a_later_batch_is_kept_and_that_batch_is_over_at_once():
    link = ScriptedLink(
        ("call", 1), ("end", 2), ("share", "k"), ("end", 1), ("call", 3), ("end", 3)
    )
    ends = BatchEnds()
    assert list(ends.messages(link, 1)) == [("call", 1), ("share", "k")]
    assert ends.early == {2}
    assert list(ends.messages(link, 2)) == []
    assert list(ends.messages(link, 3)) == [("call", 3)]
    assert link.messages == [] and ends.early == set()


@pytest.mark.parametrize(
    "follower",
    [
        lambda link: (Follower(link), lambda f, b: f.serve(None, b)),
        lambda link: (SequenceFollower(link), lambda f, b: f.serve({}, b)),
    ],
    ids=["cfg", "sequence"],
)
def test_both_followers_serve_a_batch_rank_0_ended_early_at_once(follower):
    link = ScriptedLink(("end", 8), ("end", 7))
    rank, serve = follower(link)
    serve(rank, 7)  # (batch 8's end, read meanwhile, is kept)
    assert link.messages == []
    serve(rank, 8)  # reads nothing: the link would raise IndexError
