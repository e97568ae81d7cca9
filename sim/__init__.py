"""The trace-driven simulator and capacity planner (DESIGN §12): workflow sets on a virtual
clock, running the runtime's own scheduling core, policies and admission rules."""
