"""ConversationMemory: the rolling (question, answer) turns the app carries into the next prompt."""

import threading

import pytest

from deskeye.ask.memory import ConversationMemory
from deskeye.prompt import Turn, build_messages


def test_keeps_the_last_turns_oldest_first():
    memory = ConversationMemory(max_turns=3)
    for i in range(5):
        memory.add(f"q{i}", f"a{i}")
    assert memory.turns() == [Turn("q2", "a2"), Turn("q3", "a3"), Turn("q4", "a4")]
    assert memory.last() == Turn("q4", "a4")
    assert len(memory) == 3


def test_turns_go_into_the_next_prompt_before_the_new_question():
    memory = ConversationMemory(max_turns=3)
    memory.add("What is on screen?", '{"summary": "a terminal", "key_objects": ["terminal"]}')
    messages = build_messages("And now?", b"png", memory.turns())
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[1]["content"] == "What is on screen?"
    assert "terminal" in messages[2]["content"]
    assert messages[3]["content"][-1] == {"type": "text", "text": "And now?"}


def test_clear_and_zero_turns():
    memory = ConversationMemory(max_turns=2)
    memory.add("q", "a")
    memory.clear()
    assert memory.turns() == [] and memory.last() is None
    off = ConversationMemory(max_turns=0)
    off.add("q", "a")
    assert off.turns() == []
    with pytest.raises(ValueError, match="max_turns"):
        ConversationMemory(max_turns=-1)


def test_returned_list_is_a_snapshot():
    memory = ConversationMemory(max_turns=3)
    memory.add("q1", "a1")
    snapshot = memory.turns()
    memory.add("q2", "a2")
    assert snapshot == [Turn("q1", "a1")]


def test_concurrent_adds_keep_exactly_max_turns_whole_turns():
    memory = ConversationMemory(max_turns=3)
    num_threads, num_adds = 8, 200
    sizes_seen: list[int] = []

    def writer(t: int):
        for i in range(num_adds):
            memory.add(f"q{t}-{i}", f"a{t}-{i}")
            sizes_seen.append(len(memory.turns()))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    turns = memory.turns()
    assert len(sizes_seen) == num_threads * num_adds and max(sizes_seen) == 3
    assert len(turns) == 3
    assert all(turn.question[1:] == turn.answer[1:] for turn in turns)   # never a torn pair
