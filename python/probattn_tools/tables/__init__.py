"""Scripts that read run folders and print the tables of the READMEs."""
