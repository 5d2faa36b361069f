"""The job's rank processes when their orchestrator dies (killed): the command loop of a child
ends quietly, without a traceback (a killed `dcp-jax transfer` printed 18, two per rank)."""
from multiprocessing import Pipe

from dcp_jax.job.workers import _Inbox, _serve


def test_a_live_request_learns_the_orchestrator_is_gone_and_the_loop_then_ends():
    child, parent = Pipe()
    parent.close()  # the orchestrator was killed: its end of the pipe is gone
    inbox = _Inbox(child)
    assert inbox.abort_reason() == "the job's main process is gone"
    assert inbox.get() == ("shutdown", None)  # the command loop ends after the request


def test_a_handler_that_cannot_report_to_a_dead_orchestrator_ends_the_loop_quietly(capsys):
    child, parent = Pipe()
    ran, state = [], {"sender": None}

    def request(arg):
        ran.append(arg)
        parent.close()  # dies while the request runs
        child.send(("result", arg))  # BrokenPipeError: the handler fails, and so does its report

    parent.send(("request", 1))
    parent.send(("request", 2))  # sent before it died: never served
    _serve(_Inbox(child), dict(request=request), state, "sender")  # returns, raises nothing
    assert ran == [1]
    assert "Traceback" not in capsys.readouterr().err
