"""The one driver every frontend runs through: compile steps, planner, pipeline planning, autotune, frontend protocol, CLI."""
