"""What a kernel is: its template and the code it runs, its flavor, the choice of the two (and an
environment), and the kernelspec files that name each choice."""
