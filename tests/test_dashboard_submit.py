"""`jobs.dashboard_screenshot.submit` against a fake head: it retries the refusals and dropped connections of a
loaded head until its deadline, and a retry never starts a second job (the fixed submission_id)."""
import pytest
import requests

from jobs import dashboard_screenshot
from jobs.dashboard_screenshot import submit

DROPPED = requests.ConnectionError("('Connection aborted.', RemoteDisconnected('Remote end closed connection'))")


class FakeHead:
    """Ray's job endpoint as `JobSubmissionClient.submit_job` sees it: a job per submission_id (a second
    submission of one is refused with Ray's 400), and scripted failures, each either before the head took
    the request or after it started the job (the connection dropped on the way back)."""

    def __init__(self, failures: list[tuple[str, Exception]]):
        self.failures = failures
        self.jobs: dict[str, str] = {}
        self.calls: list[str] = []

    def submit_job(self, entrypoint: str, submission_id: str, runtime_env: dict) -> str:
        self.calls.append(submission_id)
        when, error = self.failures.pop(0) if self.failures else ("", None)
        if when == "before":
            raise error
        if submission_id in self.jobs:
            raise RuntimeError(f"Request failed with status code 400: Job with submission_id {submission_id} "
                               "already exists. Please use a different submission_id..")
        self.jobs[submission_id] = entrypoint
        if when == "after":
            raise error
        return submission_id


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    monkeypatch.setattr(dashboard_screenshot.time, "sleep", lambda s: None)


def test_dropped_connections_and_missing_agent_are_retried_with_one_submission_id():
    head = FakeHead([("before", DROPPED), ("before", RuntimeError("No available agent to submit job")),
                     ("before", DROPPED)])
    job = submit(head, "python -m jobs.train")
    assert head.jobs == {job: "python -m jobs.train"}
    assert head.calls == [job] * 4


def test_a_submission_the_head_took_before_dropping_the_connection_is_not_started_twice():
    head = FakeHead([("after", DROPPED), ("before", DROPPED)])
    job = submit(head, "python -m jobs.train")
    assert head.jobs == {job: "python -m jobs.train"}
    assert head.calls == [job] * 3


def test_the_deadline_names_the_error_it_gave_up_on():
    head = FakeHead([("before", DROPPED)] * 3)
    with pytest.raises(RuntimeError, match="within 0s; last error: ConnectionError: .*RemoteDisconnected"):
        submit(head, "python -m jobs.train", wait_s=0)
    assert head.jobs == {}


def test_other_refusals_are_raised_at_once():
    head = FakeHead([("before", RuntimeError("Request failed with status code 400: bad runtime_env"))])
    with pytest.raises(RuntimeError, match="bad runtime_env"):
        submit(head, "python -m jobs.train")
    assert len(head.calls) == 1


class ExitedStart:
    """A `ray start` process that has exited (`Popen.poll`)."""

    def poll(self):
        return 1


@pytest.mark.parametrize("retry", [True, False])
@pytest.mark.parametrize("said", ["Exception: The current node timed out during startup. This could happen because",
                                  "Exception: Failed to read dashboard.err file: cannot mmap an empty file."])
def test_a_head_whose_node_timed_out_is_started_again_and_any_other_exit_raises(tmp_path, retry, said):
    """`ray start` exits when its node misses Ray's startup timeout on a loaded machine, though its dashboard
    answered a moment before, or when its dashboard has not registered in time and wrote nothing (both seen
    at load 19): `local_head` tries again (`wait_up` is False) while tries are left; another exit, or the last
    try's, raises with the log's end."""
    log = tmp_path / "ray_start.log"
    log.write_text(said + " ...\n")
    if retry:
        assert dashboard_screenshot.wait_up(ExitedStart(), log, dashboard=1, up_s=5, retry=True) is False
    else:
        with pytest.raises(RuntimeError, match=said.split(": ", 1)[1][:20]):
            dashboard_screenshot.wait_up(ExitedStart(), log, dashboard=1, up_s=5, retry=False)
    log.write_text("ValueError: --port is taken\n")
    with pytest.raises(RuntimeError, match="port is taken"):
        dashboard_screenshot.wait_up(ExitedStart(), log, dashboard=1, up_s=5, retry=True)
