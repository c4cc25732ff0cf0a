"""`tetrad calibrate`: measure the machine at hand and write a hardware profile with the schema of
a catalog GPU (tetrad.hardware.catalog), so the planner times a run on it with its one time model.

The measuring needs torch; the profile it writes and the planner that reads it do not.
"""

from tetrad.calibrate.profile import calibrate
from tetrad.hardware.profile import default_profile_path

__all__ = ["calibrate", "default_profile_path"]
