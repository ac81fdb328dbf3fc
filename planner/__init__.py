"""The deployment planner: profile the real workers, simulate the ping-pong pipeline, search plans."""
