from services.agent.repetition import RepetitionGuard


def test_guard_stops_at_a_repeated_sentence_fed_in_pieces() -> None:
    guard = RepetitionGuard()
    text = "The tower is 330 metres tall. It was built in 1889. The tower is 330 metres tall. More."
    stopped_at = None
    for i in range(0, len(text), 3):
        if guard.feed(text[i : i + 3]):
            stopped_at = i
            break
    assert stopped_at is not None
    assert guard.trim(text[: stopped_at + 3]) == "The tower is 330 metres tall. It was built in 1889."


def test_short_or_distinct_sentences_do_not_stop() -> None:
    guard = RepetitionGuard()
    assert not guard.feed("Yes. Yes. Yes. The first long sentence here. The second long sentence here. ")
    assert guard.trim("unchanged") == "unchanged"


def test_repeated_short_lines_stop_too() -> None:
    guard = RepetitionGuard()
    assert not guard.feed("The answer is:\n")
    assert guard.feed("The answer is:\n")


def test_sentences_wrapped_differently_still_count_as_repeats() -> None:
    guard = RepetitionGuard()
    text = (
        "The retriever is used to filter the\ndocuments. It is fast. The retriever is used\n"
        "to filter the documents. And more."
    )
    assert any(guard.feed(text[i : i + 5]) for i in range(0, len(text), 5))
    assert guard.repeated is not None and "retriever" in guard.repeated
