"""The live page: a federation seen while it runs, in a browser.

    from fedlb.page import LivePage, PageState

    state = PageState()
    with LivePage(state) as page:          # loopback, a free port
        print(page.url)
        run_server(settings, run, on_round=state.add_round)

`fedlb server`, `fedlb demo` and `fedlb experiment` serve it unless --no-page. It reads
the round records the process already has (fedlb.flower's RoundRecord): it adds nothing
to a round and sends nothing to the silos.
"""

from .app import MIN_TOKEN, LivePage, PageError, check_binding, is_loopback, make_app
from .state import PageState, record_json

__all__ = [
    "MIN_TOKEN",
    "LivePage",
    "PageError",
    "PageState",
    "check_binding",
    "is_loopback",
    "make_app",
    "record_json",
]
