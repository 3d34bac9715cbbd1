"""The trace simulator: replay recorded routing through the real planner on modelled hardware."""
