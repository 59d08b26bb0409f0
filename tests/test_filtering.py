"""The DialoGPT-style training-data filter, thread trees and chat logs as dialogues.

Each rule is run alone on small constructed dialogues, so a test sees exactly what
that rule removes and what it keeps.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from chatcore.errors import ChatcoreError, CorpusError, OptionError
from chatcore.training.corpus import Dialogue, is_heldout
from chatcore.training.filtering import (
    RULE_NAMES,
    Blocklist,
    FilterConfig,
    bland_threshold,
    filter_dialogues,
    load_filter_config,
    split_dialogue,
    words_of,
)
from chatcore.training.threads import (
    LogMessage,
    TreeMessage,
    load_dialogues,
    log_dialogues,
    split_heldout_by_thread,
    thread_key,
    tree_paths,
)

FILLER = ("i like the weather today", "the park is nice and green", "we went to the lake on sunday")


def only(rule: str, **settings) -> FilterConfig:
    """A config with every rule but ``rule`` switched off."""
    return FilterConfig(disable=tuple(name for name in RULE_NAMES if name != rule), **settings)


def dialogue(*turns: str, id: str = "d", community: str | None = None) -> Dialogue:
    return Dialogue(id=id, turns=turns, community=community)


def removed_targets(result) -> list[str]:
    return [example.target for report in result.report.rules for example in report.examples]


def kept_turns(result) -> list[str]:
    return [turn for d in result.dialogues for turn in d.turns]


# -- each rule --------------------------------------------------------------------------


def test_url_rule_removes_urls_in_target_and_the_reply_to_them():
    corpus = [
        dialogue("hi", "look at https://example.org/cats", "so cute", "yes", id="a"),
        dialogue("hi", "my site is www.example.net", "nice", id="b"),
        dialogue("hi", "it's on cats.com/tabby now", "ok", id="c"),
        dialogue("it costs 3.50 dollars", "that is e.g. cheap. ok", "sure", id="d"),
    ]
    result = filter_dialogues(corpus, only("url", examples=10))
    report = result.report.rule("url")
    reasons = [example.reason for example in report.examples]
    assert "look at https://example.org/cats" in removed_targets(result)
    assert "so cute" in removed_targets(result)  # its source holds the URL
    assert any(reason.startswith("source:") for reason in reasons)
    assert "my site is www.example.net" in removed_targets(result)
    assert "it's on cats.com/tabby now" in removed_targets(result)
    assert "that is e.g. cheap. ok" in kept_turns(result)  # dots are not URLs
    assert "it costs 3.50 dollars" in kept_turns(result)
    assert report.removed == 6


def test_url_rule_with_a_custom_pattern_and_wider_source():
    corpus = [dialogue("see foo://bar", "what", "huh", "ok", id="a")]
    custom = filter_dialogues(corpus, only("url", url_pattern=r"foo://\S+", source_turns=2))
    # the URL turn, and the two replies whose two-turn source holds it
    assert custom.report.rule("url").removed == 3
    assert filter_dialogues(corpus, only("url")).report.rule("url").removed == 0


def test_repeat_rule():
    corpus = [dialogue("hi", "hello", "no no no way", "no no way", "fine", "No, no, NO!", "yes yes", "ok", id="a")]
    result = filter_dialogues(corpus, only("repeat", examples=5))
    assert sorted(removed_targets(result)) == ["No, no, NO!", "no no no way"]
    assert {"no no way", "yes yes"} <= set(kept_turns(result))
    four = filter_dialogues(corpus, only("repeat", repeat_count=4))
    assert four.report.rule("repeat").removed == 0


def test_top_words_rule_removes_targets_without_frequent_words():
    common = [dialogue(*FILLER, id=f"f{i}") for i in range(5)]
    foreign = dialogue("the weather is nice", "el perro come su comida hoy", "ok", id="x")
    english = dialogue("the weather is nice", "i think the park is green today", "ok", id="y")
    result = filter_dialogues([*common, foreign, english], only("top-words", top_words=5, examples=5))
    assert removed_targets(result) == ["el perro come su comida hoy"]
    assert "ok" in kept_turns(result)  # shorter than top_words_min_words: not judged
    strict = filter_dialogues([*common, foreign, english], only("top-words", top_words=5, top_words_min_words=1))
    assert "ok" not in kept_turns(strict)
    assert set(strict.report.top_words) <= set(words_of(" ".join(FILLER)))


def test_markup_rule_and_custom_pattern():
    corpus = [dialogue("hi", "[quote] hello [/quote]", "so", "<b>bold</b>", "fine", id="a")]
    result = filter_dialogues(corpus, only("markup", examples=5))
    assert removed_targets(result) == ["[quote] hello [/quote]"]
    html = filter_dialogues(corpus, only("markup", markup_pattern=r"</?[a-z]+>", examples=5))
    assert removed_targets(html) == ["<b>bold</b>"]


def test_length_rule_counts_source_and_target_words():
    six, five, four = "a b c d e f", "g h i j k", "l m n o"
    corpus = [dialogue(six, five, four, id="a")]
    result = filter_dialogues(corpus, only("length", max_words=10, examples=5))
    assert [e.target for e in result.report.rule("length").examples] == [five]  # 6 + 5 > 10; 5 + 4 is not
    assert result.report.rule("length").examples[0].reason == "11 words"
    longer_source = filter_dialogues(corpus, only("length", max_words=12, source_turns=2))
    assert longer_source.report.rule("length").removed == 1  # 6 + 5 + 4 > 12, with two source turns


def test_blocklist_rule_with_the_default_list():
    corpus = [dialogue("hi", "what the fuck is that", "a Fucking mess", "a shitake mushroom", "hello", id="a")]
    result = filter_dialogues(corpus, only("blocklist", examples=5))
    assert sorted(removed_targets(result)) == ["a Fucking mess", "what the fuck is that"]
    assert "a shitake mushroom" in kept_turns(result)  # "shit" is a whole word, not a prefix


def test_blocklist_file_is_replaceable(tmp_path):
    words = tmp_path / "words.txt"
    words.write_text("# mine\ndarn\nheck*\nfiddle sticks\n", encoding="utf-8")
    corpus = [
        dialogue("hi", "darning socks", "oh darn it", "what the heckin", "fiddle sticks!", "the fuck", "bye", id="a")
    ]
    result = filter_dialogues(corpus, only("blocklist", blocklist_path=str(words), examples=5))
    assert sorted(removed_targets(result)) == ["fiddle sticks!", "oh darn it", "what the heckin"]
    assert {"darning socks", "the fuck"} <= set(kept_turns(result))
    blocklist = Blocklist.load(words)
    assert len(blocklist) == 3
    with pytest.raises(ValueError, match="blocklist_path"):
        FilterConfig(blocklist_path=str(tmp_path / "missing.txt"))


def test_community_rule_drops_whole_communities():
    bad = [
        dialogue("hello", "you fucking idiot", "shut up", "fuck you", id=f"b{i}", community="rude") for i in range(5)
    ]
    good = [
        dialogue("hello", "hi there", "fuck, I spilled it", "oh no", id=f"g{i}", community="nice") for i in range(5)
    ]
    unknown = [dialogue("hello", "hi", id="u")]
    corpus = [*bad, *good, *unknown]
    result = filter_dialogues(corpus, only("community", community_share=0.4, community_min_lines=10, examples=5))
    report = result.report
    assert set(report.blocked_communities) == {"rude"}  # 10/20 lines vs 5/20 in "nice"
    assert report.rule("community").removed == 20
    assert {d.community for d in result.dialogues} == {"nice", None}
    lenient = filter_dialogues(corpus, only("community", community_share=0.6))
    assert lenient.report.rule("community").removed == 0
    few_lines = filter_dialogues(corpus, only("community", community_share=0.4, community_min_lines=21))
    assert few_lines.report.rule("community").removed == 0
    no_communities = filter_dialogues(unknown, FilterConfig())
    assert no_communities.report.rule("community").status == "n/a"


def test_bland_rule_removes_targets_made_of_frequent_trigrams():
    stock = [dialogue("how are you doing", "i am doing well", id=f"s{i}") for i in range(4)]
    probe = dialogue("so how are you doing", "i am doing well thanks", "purple elephants dance at dawn", id="p")
    result = filter_dialogues([*stock, probe], only("bland", bland_min_count=4, examples=20))
    removed = removed_targets(result)
    assert "i am doing well thanks" not in removed  # 2 of 3 trigrams frequent: below 90%
    assert "so how are you doing" not in removed
    assert "purple elephants dance at dawn" in kept_turns(result)
    assert removed.count("how are you doing") == 4 and removed.count("i am doing well") == 4
    half = filter_dialogues([*stock, probe], only("bland", bland_min_count=4, bland_share=0.5))
    assert half.report.rule("bland").removed == 10  # the two probe turns with 2 of 3 join in


def test_bland_threshold_scales_with_corpus_size():
    config = FilterConfig(bland_min_count=5)
    assert bland_threshold(config, 1_000) == 5  # the floor for small corpora
    assert bland_threshold(config, 1_800_000_000) == 1000  # DialoGPT's size: its bar
    assert bland_threshold(config, 18_000_000) == 10


# -- splitting, the report, the switches ---------------------------------------------------


def test_a_removed_turn_splits_the_dialogue():
    corpus = [dialogue("a one", "b two", "[x]", "c three", "d four", id="t"), dialogue("[y]", "e", "f", id="u")]
    result = filter_dialogues(corpus, only("markup"))
    assert [(d.id, d.turns) for d in result.dialogues] == [
        ("t/1", ("a one", "b two")),
        ("t/2", ("c three", "d four")),
        ("u/1", ("e", "f")),
    ]
    assert {thread_key(d.id) for d in result.dialogues} == {"t", "u"}


def test_pieces_shorter_than_min_turns_are_orphaned():
    pieces = split_dialogue(dialogue("a", "x", "b", "c", id="t"), [False, True, False, False])
    assert [(d.id, d.turns) for d in pieces] == [("t/2", ("b", "c"))]
    untouched = dialogue("a", "b", id="t")
    assert split_dialogue(untouched, [False, False]) == [untouched]
    result = filter_dialogues([dialogue("a", "[x]", "b", "c", id="t")], only("markup"))
    assert result.report.exchanges_orphaned == 1


def test_report_counts_add_up():
    from chatcore.training.corpus import load_chitchat

    corpus = load_chitchat()[:150]
    report = filter_dialogues(corpus, FilterConfig(bland_min_count=5)).report
    assert report.exchanges_removed == sum(rule.removed for rule in report.rules)
    assert report.exchanges_in == report.exchanges_removed + report.exchanges_orphaned + report.exchanges_out
    assert all(rule.matched >= rule.removed for rule in report.rules)
    assert all(len(rule.examples) <= 3 for rule in report.rules)
    assert report.exchanges_removed > 0
    text = report.format(examples=2)
    for name in RULE_NAMES:
        assert name in text
    json.dumps(report.to_dict())  # the --filter-report file


def test_disabled_rules_do_not_run():
    corpus = [dialogue("hi", "see https://x.org [1]", "no no no", "ok", id="a")]
    everything = filter_dialogues(corpus, FilterConfig())
    assert everything.report.rule("url").removed == 2  # the URL turn and the reply to it
    assert everything.report.rule("markup").matched == 1  # also matched, counted by url
    off = filter_dialogues(corpus, FilterConfig(disable=("url", "markup", "repeat")))
    assert off.report.rule("url").status == "off"
    assert off.report.exchanges_removed == 0
    assert off.dialogues == corpus


def test_config_updates_from_strings_and_files(tmp_path):
    config = FilterConfig().updated({"max_words": "300", "bland_share": "0.8", "disable": "url, bland"})
    assert (config.max_words, config.bland_share, config.disable) == (300, 0.8, ("url", "bland"))
    json_file = tmp_path / "filter.json"
    json_file.write_text(json.dumps({"disable": ["blocklist"], "repeat_count": 4}))
    assert load_filter_config(json_file).repeat_count == 4
    toml_file = tmp_path / "filter.toml"
    toml_file.write_text('disable = ["url"]\nmax_words = 120\ncommunity_share = 0.25\n')
    loaded = load_filter_config(toml_file)
    assert (loaded.disable, loaded.max_words, loaded.community_share) == (("url",), 120, 0.25)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"max_word": 3}, "unknown filter setting 'max_word'"),
        ({"disable": ["urls"]}, "unknown rule 'urls'"),
        ({"max_words": 0}, "`max_words` must be a positive integer, got 0"),
        ({"max_words": "many"}, "`max_words` must be an integer, got 'many'"),
        ({"bland_share": "half"}, "`bland_share` must be a number, got 'half'"),
        ({"disable": 3}, "`disable` must be a list (comma-separated), got 3"),
        ({"bland_share": 1.5}, "`bland_share` must be in (0, 1], got 1.5"),
        ({"markup_pattern": "[unclosed"}, "`markup_pattern` is not a valid regular expression"),
        ({"repeat_count": 1}, "`repeat_count` must be an integer of at least 2"),
    ],
)
def test_bad_settings_are_clear_errors(values, needle):
    with pytest.raises(OptionError) as error:
        FilterConfig().updated(values)
    assert needle in str(error.value)


def test_bad_config_files(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(OptionError, match="not valid JSON"):
        load_filter_config(broken)
    with pytest.raises(OptionError, match="not found"):
        load_filter_config(tmp_path / "absent.json")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(OptionError, match="expected an object"):
        load_filter_config(listed)


@pytest.mark.parametrize("command", ["filter", "model"])
def test_a_filter_config_that_is_not_utf8_text_is_one_line(tmp_path, command):
    binary = tmp_path / "bin.dat"
    binary.write_bytes(bytes(range(128, 256)) * 2)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"turns": ["hi", "hello"]}\n')
    result = _cli(
        "train", command, "--corpus", str(corpus), "--filter-config", str(binary), "--out", str(tmp_path / "out")
    )
    assert _one_line_error(result) == f"Error: filter config {binary}: not JSON text (not UTF-8 at byte 0)"
    assert not (tmp_path / "out").exists()


# -- thread trees and chat logs ----------------------------------------------------------


def test_every_root_to_leaf_path_is_a_dialogue():
    messages = [
        TreeMessage("r", None, "what should I cook?", "cooking"),
        TreeMessage("a", "r", "pasta"),
        TreeMessage("b", "r", "beans"),
        TreeMessage("a1", "a", "with what sauce?"),
        TreeMessage("a2", "a", "again?"),
        TreeMessage("a1x", "a1", "tomato"),
        TreeMessage("lonely", None, "anyone?"),  # no reply: no dialogue
        TreeMessage("o", "deleted-parent", "orphan start", "other"),
        TreeMessage("o1", "o", "orphan reply"),
        TreeMessage("gone", "r", "  "),  # empty text ends its paths ...
        TreeMessage("g1", "gone", "reply to nothing"),
        TreeMessage("g2", "g1", "and on"),  # ... and its replies start a new tree
    ]
    paths = {d.id: (d.turns, d.community) for d in tree_paths(messages)}
    assert paths == {
        "r/a1x": (("what should I cook?", "pasta", "with what sauce?", "tomato"), "cooking"),
        "r/a2": (("what should I cook?", "pasta", "again?"), "cooking"),
        "r/b": (("what should I cook?", "beans"), "cooking"),
        "o/o1": (("orphan start", "orphan reply"), "other"),
        "g1/g2": (("reply to nothing", "and on"), None),
    }


def test_tree_paths_survive_deep_threads_and_refuse_duplicate_ids():
    deep = [TreeMessage("m0", None, "start")] + [
        TreeMessage(f"m{i}", f"m{i - 1}", f"reply {i}") for i in range(1, 3000)
    ]
    (path,) = tree_paths(deep)
    assert len(path.turns) == 3000
    with pytest.raises(CorpusError, match="appears twice"):
        tree_paths([TreeMessage("x", None, "a"), TreeMessage("x", None, "b")])


def test_held_out_split_keeps_a_thread_together():
    dialogues = [Dialogue(id=f"root{i}/leaf{j}", turns=("a", "b")) for i in range(60) for j in range(3)]
    train, heldout = split_heldout_by_thread(dialogues, 0.2)
    assert heldout and train
    assert {thread_key(d.id) for d in train}.isdisjoint(thread_key(d.id) for d in heldout)
    assert all(is_heldout(thread_key(d.id), 0.2) for d in heldout)
    plain = [Dialogue(id=f"chitchat:{i}", turns=("a", "b")) for i in range(100)]
    assert split_heldout_by_thread(plain, 0.2)[1] == [d for d in plain if is_heldout(d.id, 0.2)]


def test_chat_log_groups_authors_and_splits_at_silences():
    log = [
        LogMessage("general", "anyone up?", "ann", 0.0),
        LogMessage("general", "hello?", "ann", 10.0),
        LogMessage("general", "me", "bo", 20.0),
        LogMessage("random", "cats!", "cy", 25.0),
        LogMessage("general", "cool", "ann", 30.0),
        LogMessage("general", "next morning", "bo", 40_000.0),
        LogMessage("general", "morning", "ann", 40_010.0),
        LogMessage("random", "dogs!", "di", 26.0),
    ]
    dialogues = log_dialogues(log, gap_seconds=3600)
    assert [(d.id, d.turns, d.community) for d in dialogues] == [
        ("general@1", ("anyone up? hello?", "me", "cool"), "general"),
        ("general@2", ("next morning", "morning"), "general"),
        ("random@1", ("cats!", "dogs!"), "random"),
    ]
    chunks = log_dialogues([LogMessage("c", f"m{i}", f"u{i % 2}") for i in range(10)], max_turns=4)
    assert [len(d.turns) for d in chunks] == [4, 4, 2]


def test_load_dialogues_detects_the_file_format(tmp_path):
    tree = tmp_path / "tree.jsonl"
    tree.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"id": "t1", "parent_id": None, "text": "root", "community": "sub"},
                {"id": "t2", "parent_id": "t1", "text": "reply"},
            ]
        )
    )
    log = tmp_path / "log.jsonl"
    log.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"channel": "c", "author": "a", "text": "hi", "time": "2024-01-01T10:00:00Z"},
                {"channel": "c", "author": "b", "text": "hello", "time": "2024-01-01T10:01:00Z"},
            ]
        )
    )
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"id": "p", "turns": ["x", "y"], "community": "room"}))
    assert load_dialogues(str(tree)) == [Dialogue("t1/t2", ("root", "reply"), "sub")]
    assert load_dialogues(str(log)) == [Dialogue("c@1", ("hi", "hello"), "c")]
    assert load_dialogues(str(plain)) == [Dialogue("p", ("x", "y"), "room")]
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"message": "hi"}))
    with pytest.raises(CorpusError, match="unrecognized record"):
        load_dialogues(str(odd))
    bad_tree = tmp_path / "bad_tree.jsonl"
    bad_tree.write_text(
        json.dumps({"id": "t1", "parent_id": None, "text": "x"}) + "\n" + json.dumps({"id": "t2", "text": "y"})
    )
    with pytest.raises(CorpusError, match='needs "parent_id"'):
        load_dialogues(str(bad_tree))


# -- the command line ----------------------------------------------------------------------


def _cli(*args):
    from chatcore.cli import build_cli

    return CliRunner().invoke(build_cli(), list(args), catch_exceptions=True)


def test_train_filter_command_writes_kept_dialogues(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rows = [
        {"id": f"d{i}", "turns": ["hi there friend", "see http://spam.example.com now", "wow", "ok then", "sure thing"]}
        for i in range(3)
    ]
    corpus.write_text("\n".join(json.dumps(r) for r in rows))
    out, report = tmp_path / "kept.jsonl", tmp_path / "report.json"
    result = _cli(
        "train",
        "filter",
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--filter-report",
        str(report),
        "--filter-disable",
        "bland,top-words",
    )
    assert result.exit_code == 0, result.output
    assert "url" in result.output and "removed" in result.output
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert {tuple(k["turns"]) for k in kept} == {("ok then", "sure thing")}  # the URL and its reply are cut
    data = json.loads(report.read_text())
    assert {rule["name"]: rule["removed"] for rule in data["rules"]}["url"] == 6


def test_bad_filter_options_are_one_line_errors(tmp_path):
    result = _cli("train", "filter", "--corpus", "chitchat", "--filter-disable", "nonsense")
    assert result.exit_code != 0
    assert "unknown rule 'nonsense'" in result.output and "Traceback" not in result.output
    result = _cli("train", "filter", "--corpus", "chitchat", "--filter-set", "max_words")
    assert result.exit_code != 0 and "KEY=VALUE" in result.output


def test_errors_are_chatcore_errors():
    assert issubclass(OptionError, ChatcoreError) and issubclass(CorpusError, ChatcoreError)


def _one_line_error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code != 0 and "Traceback" not in result.output and len(lines) == 1, result.output
    return lines[0]


def _small_corpus(path):
    rows = [{"id": f"d{i}", "turns": ["hi there friend", "hello, how are you?", "fine thanks"]} for i in range(4)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_train_filter_refuses_an_existing_output_and_always_the_corpus(tmp_path):
    corpus = _small_corpus(tmp_path / "corpus.jsonl")
    text = corpus.read_text()
    existing = tmp_path / "kept.jsonl"
    existing.write_text("mine\n")
    disable = ("--filter-disable", "bland,top-words")
    line = _one_line_error(_cli("train", "filter", "--corpus", str(corpus), "--out", str(existing), *disable))
    assert "--out" in line and "exists: give --force to replace it" in line
    report = _cli("train", "filter", "--corpus", str(corpus), "--filter-report", str(existing), *disable)
    assert "--filter-report" in _one_line_error(report) and existing.read_text() == "mine\n"
    for option in ("--out", "--filter-report"):
        result = _cli("train", "filter", "--corpus", str(corpus), option, str(corpus), "--force", *disable)
        assert f"{option} {str(corpus)!r} is the corpus being read" in _one_line_error(result)
    assert corpus.read_text() == text
    replaced = _cli("train", "filter", "--corpus", str(corpus), "--out", str(existing), "--force", *disable)
    assert replaced.exit_code == 0, replaced.output
    assert json.loads(existing.read_text().splitlines()[0])["turns"][0] == "hi there friend"


def test_train_tokenizer_refuses_a_folder_that_holds_a_tokenizer(tmp_path):
    corpus = _small_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "tokenizer"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    arguments = ("train", "tokenizer", "--corpus", str(corpus), "--no-filter", "--vocab-size", "300")
    line = _one_line_error(_cli(*arguments, "--out", str(out)))
    assert "already holds a tokenizer (tokenizer.json): give --force to replace it" in line
    assert (out / "tokenizer.json").read_text() == "{}"
    report = _cli(*arguments, "--out", str(tmp_path / "new"), "--filter-report", str(corpus))
    assert "is the corpus being read" in _one_line_error(report)
    assert _cli(*arguments, "--out", str(out), "--force").exit_code == 0
    assert (out / "tokenizer.json").read_text() != "{}"


def test_train_model_refuses_an_existing_filter_report_unless_force(tmp_path):
    corpus = _small_corpus(tmp_path / "corpus.jsonl")
    report = tmp_path / "report.json"
    report.write_text("mine\n")
    out = tmp_path / "run"
    arguments = ["train", "model", "--corpus", str(corpus), "--out", str(out), "--tokenizer", "chatcore-tiny"]
    arguments += ["--filter-disable", "bland,top-words", "--filter-report", str(report), "--device", "cpu", "--quiet"]
    arguments += ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--n-positions", "64", "--block-size", "32"]
    arguments += ["--heldout", "0", "--epochs", "1", "--batch-size", "2"]
    line = _one_line_error(_cli(*arguments))
    assert f"--filter-report {str(report)!r} exists: give --force to replace it" in line
    assert report.read_text() == "mine\n" and not out.exists()  # refused before any work
    replaced = _cli(*arguments, "--force")
    assert replaced.exit_code == 0, replaced.output
    assert json.loads(report.read_text()) == json.loads((out / "filter_report.json").read_text())


@pytest.mark.parametrize("command", ["filter", "tokenizer", "model", "cocon"])
def test_a_folder_given_as_corpus_is_one_line(tmp_path, command):
    arguments = ["train", command, "--corpus", str(tmp_path)]
    if command != "filter":
        arguments += ["--out", str(tmp_path / "out")]
    line = _one_line_error(_cli(*arguments, "--device", "cpu") if command == "cocon" else _cli(*arguments))
    assert f"{tmp_path} is a folder, not a corpus file" in line


def test_a_byte_order_mark_reads_as_no_text_in_every_corpus_and_data_file(tmp_path):
    """Each format, the labelled files of `train discriminator` and the contrast files of
    `train vector` read the same with a leading UTF-8 byte-order mark as without."""
    from chatcore.plugins.pplm.train_discriminator import read_labelled_file
    from chatcore.plugins.vector.vectors import read_texts

    files = {
        "dialogues.jsonl": [{"id": "d1", "turns": ["hi there", "hello, how are you?"]}],
        "tree.jsonl": [
            {"id": "t1", "parent_id": None, "text": "what should I cook?"},
            {"id": "t2", "parent_id": "t1", "text": "pasta"},
        ],
        "log.jsonl": [
            {"channel": "c", "author": "ann", "text": "anyone up?"},
            {"channel": "c", "author": "bo", "text": "me"},
        ],
        "labels.jsonl": [{"label": "a", "text": "one"}, {"label": "a", "text": "two"}]
        + [{"label": "b", "text": "three"}, {"label": "b", "text": "four"}],
        "texts.txt": ["first line", "second line"],
    }
    for name, records in files.items():
        lines = [record if isinstance(record, str) else json.dumps(record) for record in records]
        plain, marked = tmp_path / f"plain-{name}", tmp_path / f"marked-{name}"
        plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
        marked.write_text("\n".join(lines) + "\n", encoding="utf-8-sig")
        read = read_labelled_file if name.startswith("labels") else read_texts if name.endswith(".txt") else None
        if read is None:
            assert load_dialogues(str(marked)) == load_dialogues(str(plain)), name
        else:
            assert read(marked) == read(plain), name
    corpus = tmp_path / "marked-dialogues.jsonl"
    result = _cli("train", "filter", "--corpus", str(corpus), "--filter-disable", "bland,top-words")
    assert result.exit_code == 0, result.output


def test_a_failed_tokenizer_run_leaves_no_empty_out_folder(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "tok"
    result = _cli("train", "tokenizer", "--corpus", str(empty), "--no-filter", "--out", str(out))
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert not out.exists()


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (["--tokenizer", "./no-such-tokenizer"], "'./no-such-tokenizer' does not exist"),
        (["--init-from", "./no-such-model"], "'./no-such-model' does not exist"),
        (["--tokenizer", "chatcore-tiny", "--n-positions", "64", "--block-size", "128"], "block size 128 exceeds"),
        (["--init-from", "chatcore-tiny", "--block-size", "4096"], "block size 4096 exceeds"),
    ],
)
def test_train_model_checks_its_tokenizer_model_and_block_size_before_filtering(tmp_path, options, needle):
    """Refused before the corpus is filtered: no filter report is printed nor left in --out."""
    corpus = _small_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "run"
    result = _cli("train", "model", "--corpus", str(corpus), "--out", str(out), "--quiet", "--device", "cpu", *options)
    assert needle in _one_line_error(result) and "filtering:" not in result.stdout, result.output
    assert not out.exists()


def test_fine_tuning_with_a_larger_tokenizer_than_the_models_embeddings_is_refused_first(tmp_path, tiny_model_dir):
    corpus = _small_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "run"
    arguments = ["train", "model", "--corpus", str(corpus), "--out", str(out), "--quiet", "--device", "cpu"]
    arguments += ["--init-from", str(tiny_model_dir), "--tokenizer", "chatcore-tiny", "--block-size", "32"]
    line = _one_line_error(_cli(*arguments))
    assert line == (
        "Error: --tokenizer's vocabulary (8,192) is larger than --init-from's embeddings (400): "
        "give the tokenizer the model was trained with (or leave --tokenizer out)"
    )
    assert not out.exists()
