"""Generator replicas: the pool (`pool`), its supervision (`supervision`), deadlines and errors."""
