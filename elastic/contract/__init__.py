"""What a worker and its agent share: the files and values that pass between them.

    events.py           one JSON line per thing that happened, for people and tools (observation only)
    agent_channel.py    what a running worker tells its agent to act on: typed messages, by host
    progress.py         progress marks on a shared page, read by the agent's hang watchdog
    worker_config.py    what the agent tells a worker through its environment
    console.py          which lines reach the console and which stay in the log file
    log_files.py        log rotation at a size bound, and reading rotated logs back
    errors.py           the runtime's errors
    faults.py           what a failure means (its kind and line), and the worker's exit record
    reset_budget.py     how many failures a job survives (worker and agent count alike)
    straggler_policy.py the straggler options, and when evicting one is allowed
    timeouts.py         the job's timeouts together: the combinations refused or warned about
    exit_codes.py       the exit statuses of a worker and of elastic-run, and what each means
    round_keys.py       the keys of a round's store (its namespace, arrival, outcome, switch)

Imported by both sides; imports nothing of ``elastic`` outside this room.
"""
