"""The comparative report: the study read once into one value (study), its tables (tables) and
charts (charts), and the page that holds them (page)."""
