"""`Options(compile="background")`: a compile worker process makes the compiled function
while plain graphs serve (`line`: the caller's side; `jobs`: one function's compiles;
`worker`: the process; `job_pickle`: what crosses to it)."""
