"""The conversations folder is a boundary: ids from files never name a path, malformed files are
listed as unreadable with a reason, and nothing outside the folder is written or deleted."""

from __future__ import annotations

import json
import os
import time

import pytest
from specdec_app.conversations import (
    STALE_TEMP_AGE_S,
    Conversation,
    ConversationError,
    ConversationStore,
    StoredMessage,
    StoredToken,
)


@pytest.fixture
def store(tmp_path) -> ConversationStore:
    return ConversationStore(tmp_path / "data")


@pytest.fixture
def victim(tmp_path):
    """A file outside the data folder that a hostile conversation file aims at."""
    path = tmp_path / "outside" / "victim.json"
    path.parent.mkdir()
    path.write_text("precious", encoding="utf-8")
    return path


def _write(store: ConversationStore, name: str, content: object) -> None:
    store.root.mkdir(parents=True, exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content)
    (store.root / name).write_text(text, encoding="utf-8")


def test_the_file_name_is_the_id_so_a_hostile_json_id_cannot_make_delete_leave_the_folder(store, victim):
    _write(store, "shared.json", {"id": "../../outside/victim", "title": "Shared", "messages": []})
    [listed] = store.list()
    assert listed.id == "shared" and listed.title == "Shared"
    store.delete(listed.id)
    assert victim.read_text(encoding="utf-8") == "precious"
    assert store.list() == []


@pytest.mark.parametrize("bad_id", ["../../outside/victim", "..", "a/b", "a\\b", ".hidden", "", "x" * 65, "é"])
def test_an_id_that_could_name_a_path_is_refused_by_every_operation(store, victim, bad_id):
    for operation in (store.path, store.load, store.delete):
        with pytest.raises(ConversationError, match="not a conversation id"):
            operation(bad_id)
    with pytest.raises(ConversationError, match="not a conversation id"):
        store.save(Conversation(id=bad_id))
    assert not store.exists(bad_id)
    assert victim.read_text(encoding="utf-8") == "precious"
    assert not store.root.exists() or list(store.root.iterdir()) == []


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ({"id": "t", "messages": [1]}, "messages[0] is int, not an object"),
        ("{not json", "not valid JSON"),
        ([1, 2], "holds list, not a conversation object"),
        ({"title": "x"}, "messages is missing"),
        ({"messages": [{"role": "user"}]}, "messages[0].content is missing"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "'robot', not 'user' or 'assistant'"),
        ({"messages": [], "title": 7}, "title is int, not text"),
        ({"messages": [], "updated": "yesterday"}, "updated is str, not a number"),
        ({"messages": [{"role": "assistant", "content": "a", "tokens": [["a", "bonus"]]}]}, "tokens[0] is not a"),
        ({"messages": [{"role": "assistant", "content": "a", "tokens": [["a", "x", 1, "hi", None]]}]},
         "tokens[0][3] is not a probability"),
        ({"messages": [{"role": "user", "content": "a", "stopped": "yes"}]}, "stopped is str, not true/false"),
        ("[" * 100_000, "nested too deeply"),
    ],
)
def test_a_malformed_file_is_listed_as_unreadable_with_its_reason(store, content, reason):
    good = Conversation.new()
    store.save(good)
    _write(store, "t.json", content)
    listing = store.scan()
    assert [c.id for c in listing.conversations] == [good.id]
    [unreadable] = listing.unreadable
    assert unreadable.name == "t.json" and unreadable.conversation_id == "t"
    assert reason in unreadable.reason and "\n" not in unreadable.reason
    with pytest.raises(ValueError, match=r"t\.json"):  # ConversationError is a ValueError
        store.load("t")


def test_invalid_utf8_and_badly_named_files_are_unreadable_not_fatal(store):
    store.root.mkdir(parents=True)
    (store.root / "latin1.json").write_bytes(b'{"messages": [], "title": "caf\xe9"}')
    _write(store, "my chat.json", {"messages": []})
    unreadable = {u.name: u for u in store.scan().unreadable}
    assert "cannot read latin1.json" in unreadable["latin1.json"].reason
    assert unreadable["my chat.json"].conversation_id is None  # Delete cannot be asked for it


def test_list_ignores_temp_and_dot_files_and_cleans_only_stale_temp_files(store):
    store.save(Conversation.new())
    _write(store, ".tmp-fresh.json", "{half a sav")
    _write(store, ".tmp-killed.json", "{half a sav")
    _write(store, ".DS_Store.json", "junk")
    _write(store, "notes.txt", "not a conversation")
    old = time.time() - STALE_TEMP_AGE_S - 60
    os.utime(store.root / ".tmp-killed.json", (old, old))
    listing = store.scan()
    assert len(listing.conversations) == 1 and listing.unreadable == ()
    assert (store.root / ".tmp-fresh.json").exists()  # may be another instance's save in progress
    assert not (store.root / ".tmp-killed.json").exists()


def test_a_round_trip_keeps_every_field_and_writes_the_file_name_as_id(store):
    conversation = Conversation.new("be brief")
    conversation.title = "Kept"
    conversation.messages += [
        StoredMessage("user", "2+2?"),
        StoredMessage("assistant", "4", [StoredToken("4", "bonus", 1, 0.9, None)], "Draft: x", stopped=True),
    ]
    store.save(conversation)
    again = store.load(conversation.id)
    assert again == conversation
    assert json.loads(store.path(conversation.id).read_text(encoding="utf-8"))["id"] == conversation.id


def test_the_file_holds_one_message_a_line_so_a_save_encodes_a_message_at_a_time(store):
    conversation = Conversation.new()
    conversation.messages += [StoredMessage("user", "a\nb"), StoredMessage("assistant", "c", [StoredToken("c", "target", 1)])]
    store.save(conversation)
    text = store.path(conversation.id).read_text(encoding="utf-8")
    assert json.loads(text) == conversation.to_json()
    rows = [json.loads(line.rstrip(",")) for line in text.splitlines() if line.startswith('{"role"')]
    assert rows == [m.to_json() for m in conversation.messages]


def test_a_full_disk_is_one_line_and_keeps_the_saved_file(store, monkeypatch):
    conversation = Conversation.new()
    conversation.messages.append(StoredMessage("user", "kept"))
    store.save(conversation)
    before = store.path(conversation.id).read_bytes()
    conversation.messages.append(StoredMessage("assistant", "lost to a full disk"))

    def full(_fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ConversationError, match=rf"cannot save {conversation.id}\.json: No space left on device$"):
        store.save(conversation)
    assert store.path(conversation.id).read_bytes() == before
    assert [p.name for p in store.root.iterdir()] == [f"{conversation.id}.json"]  # no temp file left
