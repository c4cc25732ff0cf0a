"""Pipeline schedules as data: per rank, an ordered list of compute and send/receive actions,
built by one function per schedule, checked by a validator, timed by a simulator. One executor
runs any of them; the planner takes its bubble term from the same timelines. No torch here.
See docs/pipeline.md."""

from tetrad.schedules.actions import Action, Schedule, ScheduleError
from tetrad.schedules.generate import SCHEDULES, build_schedule
from tetrad.schedules.render import render
from tetrad.schedules.simulate import ActionCosts, Durations, Timeline, peak_in_flight, simulate
from tetrad.schedules.validate import validate

__all__ = ["Action", "Schedule", "ScheduleError", "SCHEDULES", "build_schedule", "render",
           "ActionCosts", "Durations", "Timeline", "peak_in_flight", "simulate", "validate"]
