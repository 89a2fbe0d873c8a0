"""relay.Frames: the messages on a rank's message pipe come back whole, once, in order, however the pipe cut
them; a frame that cannot be unpickled is dropped without losing the ones after it."""

from __future__ import annotations

import pickle
import struct

from accel_magic.launch.relay import Frames, frame

HELLO = {"hello": 4242}
DISPLAY = {
    "msg_or_type": "display_data",
    "content": {"data": {"text/plain": "tensor([1., 2.]) é €"}, "metadata": {}},
    "buffers": [b"\x00\x01\x02" * 100],
}


def test_a_frame_fed_one_byte_at_a_time_yields_its_message_once_when_its_last_byte_arrives() -> None:
    data = frame(DISPLAY)
    frames = Frames()
    yielded = [list(frames.feed(data[i : i + 1])) for i in range(len(data))]
    assert yielded[:-1] == [[]] * (len(data) - 1)
    assert yielded[-1] == [DISPLAY]


def test_a_frame_cut_in_two_at_any_byte_yields_its_message_once() -> None:
    data = frame(HELLO)
    for cut in range(len(data) + 1):
        frames = Frames()
        got = list(frames.feed(data[:cut])) + list(frames.feed(data[cut:]))
        assert got == [HELLO], cut


def test_two_frames_in_one_chunk_yield_both_in_order() -> None:
    assert list(Frames().feed(frame(HELLO) + frame(DISPLAY))) == [HELLO, DISPLAY]


def test_a_frame_whose_header_promises_more_than_arrived_waits_for_the_rest() -> None:
    data = frame(DISPLAY)
    frames = Frames()
    assert list(frames.feed(data[:-1])) == []
    assert list(frames.feed(b"")) == []
    assert list(frames.feed(data[-1:] + frame(HELLO))) == [DISPLAY, HELLO]


def test_a_frame_whose_body_is_not_a_pickle_is_dropped_and_the_next_one_still_decodes() -> None:
    garbage = b"this is not a pickle"
    truncated = pickle.dumps(DISPLAY, protocol=pickle.HIGHEST_PROTOCOL)[:-5]
    chunk = (
        struct.pack("!I", len(garbage))
        + garbage
        + frame(HELLO)
        + struct.pack("!I", len(truncated))
        + truncated
        + frame(DISPLAY)
    )
    assert list(Frames().feed(chunk)) == [HELLO, DISPLAY]
