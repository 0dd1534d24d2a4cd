"""The experiment config: its schema (``schema``) and how it is read (``loading``)."""
