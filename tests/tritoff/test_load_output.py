"""tritoff/load_output.py: what a pipeline's load prints is held until it ends, then shown in its order or dropped."""

import logging
import warnings

import pytest


class Seen(logging.Handler):
    """A handler recording the messages it gets."""

    def __init__(self):
        super().__init__()
        self.said = []

    def emit(self, record):
        self.said.append(record.getMessage())


@pytest.fixture
def handlers():
    """A handler on transformers' library logger and one on an inner logger of diffusers, removed afterwards."""
    import diffusers  # noqa: F401 - each library's own handler first, as when it is loaded
    import transformers  # noqa: F401

    library, inner = logging.getLogger("transformers"), logging.getLogger("diffusers.configuration_utils")
    seen = Seen(), Seen()
    library.addHandler(seen[0])
    inner.addHandler(seen[1])
    yield seen
    library.removeHandler(seen[0])
    inner.removeHandler(seen[1])


@pytest.mark.parametrize("dropped", [False, True])
def test_a_load_s_warnings_and_log_records_are_shown_after_it_in_their_order_unless_dropped(handlers, dropped):
    from tritoff.load_output import held_load_output

    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *rest, **named: shown.append(str(message))
        with held_load_output() as held:
            logging.getLogger("transformers.modeling_utils").warning("a load report")
            warnings.warn("a load's warning", UserWarning, stacklevel=1)
            logging.getLogger("diffusers.configuration_utils").warning("unknown config keys")
            # held while it loads, but for a handler the user put on an inner logger: it has its records as they come
            assert shown == [] and handlers[0].said == [] and handlers[1].said == ["unknown config keys"]
            order = []
            held.items and order.extend(kind for kind, _ in held.items)
            if dropped:
                held.drop()
        assert order == ["record", "warning", "record"]
        assert handlers[0].said == ([] if dropped else ["a load report"])
        assert shown == ([] if dropped else ["a load's warning"])
        assert handlers[1].said == ["unknown config keys"]  # once: not again when the held records are shown
    logging.getLogger("transformers.modeling_utils").warning("after the load")
    assert handlers[0].said[-1] == "after the load"  # the libraries' handlers are back


def test_filters_a_load_adds_stay_and_an_error_inside_shows_what_was_held(handlers):
    from tritoff.load_output import held_load_output

    before = warnings.showwarning
    with warnings.catch_warnings(), pytest.raises(KeyError):
        with held_load_output():
            warnings.filterwarnings("ignore", message="a library's own filter")  # as a library's import adds one
            logging.getLogger("transformers").warning("said before the error")
            raise KeyError("the load failed")
        assert any(f[1] is not None and f[1].pattern == "a library's own filter" for f in warnings.filters)
    assert handlers[0].said == ["said before the error"] and warnings.showwarning is before


def test_a_filter_on_a_library_s_logger_does_not_judge_its_inner_loggers_records(handlers):
    # logging never applies a logger's filters to records passed up from inner loggers: shown again through the
    # library's logger, they were filtered out
    from tritoff.load_output import held_load_output

    library = logging.getLogger("transformers")
    only_its_own = logging.Filter("nothing-named-this")
    library.addFilter(only_its_own)
    try:
        with held_load_output():
            logging.getLogger("transformers.modeling_utils").warning("from an inner logger")
    finally:
        library.removeFilter(only_its_own)
    assert handlers[0].said == ["from an inner logger"]
