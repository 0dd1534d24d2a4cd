"""MLflow tracking: the store and its connection, runs, UI links and system metrics. No Ray and no
torch here: Ray Train's controller and the CLI import it cheaply."""
