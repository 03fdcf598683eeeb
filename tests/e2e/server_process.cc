#include "tests/e2e/server_process.h"

#include <grpcpp/create_channel.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/proc_stat.h"

namespace epserve::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

pid_t Spawn(int ranks, const std::vector<std::string>& args, const std::string& log,
            const std::vector<std::string>& mpirun_args = {}) {
  std::vector<std::string> argv = {EPSERVE_MPIEXEC,   "-np",       std::to_string(ranks),
                                   "--oversubscribe", "--bind-to", "none"};
  argv.insert(argv.end(), mpirun_args.begin(), mpirun_args.end());
  argv.push_back(EPSERVE_BINARY);
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    setpgid(0, 0);  // its own process group, so a hard kill reaches every rank
    std::vector<char*> c;
    for (std::string& a : argv) c.push_back(a.data());
    c.push_back(nullptr);
    execv(c[0], c.data());
    _exit(127);
  }
  return pid;
}

// Waits for `pid` until `deadline`; the exit code, -1 if killed, or nullopt on timeout.
std::optional<int> WaitFor(pid_t pid, absl::Time deadline) {
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (absl::Now() >= deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::vector<std::string> WithDefaults(std::vector<std::string> args, const std::string& dir) {
  std::vector<std::string> all = {"--model=synthetic:tiny", "--grpc-address=127.0.0.1:0",
                                  "--metrics-address=127.0.0.1:0",
                                  absl::StrCat("--ready-file=", dir, "/ready.json")};
  all.insert(all.end(), args.begin(), args.end());  // later flags win
  return all;
}

// mpirun and its children (each rank leads its own process group).
std::vector<common::ProcStat> JobProcesses(pid_t mpirun) {
  std::vector<common::ProcStat> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::optional<common::ProcStat> p =
        common::ParseProcStat(ReadFile(entry.path().string() + "/stat"));
    if (p && (p->pid == mpirun || p->ppid == mpirun || p->pgrp == mpirun)) out.push_back(*p);
  }
  return out;
}

// SIGKILL to mpirun's process group and to the ranks, which lead groups of their own.
void KillJob(pid_t mpirun) {
  for (const common::ProcStat& p : JobProcesses(mpirun)) {
    if (p.pid != mpirun) kill(p.pid, SIGKILL);
  }
  kill(-mpirun, SIGKILL);
}

std::string TempDir() {
  char tmpl[] = "/tmp/epserve-test-XXXXXX";
  return mkdtemp(tmpl);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    int ranks, std::vector<std::string> args, absl::Duration ready_timeout,
    std::vector<std::string> mpirun_args) {
  auto p = std::unique_ptr<ServerProcess>(new ServerProcess());
  p->dir_ = TempDir();
  p->pid_ = Spawn(ranks, WithDefaults(std::move(args), p->dir_), p->dir_ + "/log.txt", mpirun_args);
  const absl::Time deadline = absl::Now() + ready_timeout;
  const std::regex re("\"grpc\": \"([^\"]+)\", \"metrics\": \"([^\"]+)\"");
  while (absl::Now() < deadline) {
    std::smatch m;
    const std::string ready = ReadFile(p->dir_ + "/ready.json");
    if (std::regex_search(ready, m, re)) {
      p->grpc_address_ = m[1];
      p->metrics_address_ = m[2];
      return p;
    }
    int status = 0;
    if (waitpid(p->pid_, &status, WNOHANG) == p->pid_) {
      p->pid_ = -1;
      return absl::InternalError(absl::StrCat("server exited before it was ready:\n", p->Log()));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat("server not ready in time:\n", p->Log()));
}

absl::StatusOr<std::pair<int, std::string>> ServerProcess::RunToExit(int ranks,
                                                                     std::vector<std::string> args,
                                                                     absl::Duration timeout) {
  const std::string dir = TempDir();
  const pid_t pid = Spawn(ranks, WithDefaults(std::move(args), dir), dir + "/log.txt");
  std::optional<int> code = WaitFor(pid, absl::Now() + timeout);
  if (!code) {
    KillJob(pid);
    WaitFor(pid, absl::InfiniteFuture());
    return absl::DeadlineExceededError("the job did not exit in time");
  }
  return std::make_pair(*code, ReadFile(dir + "/log.txt"));
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    KillJob(pid_);
    WaitFor(pid_, absl::InfiniteFuture());
  }
}

std::string ServerProcess::Log() const { return ReadFile(dir_ + "/log.txt"); }

std::string ServerProcess::WaitForLog(const std::function<bool(const std::string&)>& done,
                                      absl::Duration wait) const {
  const absl::Time deadline = absl::Now() + wait;
  std::string log = Log();
  while (!done(log) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
    log = Log();
  }
  return log;
}

pid_t ServerProcess::RankPid(int rank, absl::Duration wait) const {
  if (pid_ <= 0) return -1;
  const std::string want = absl::StrCat("OMPI_COMM_WORLD_RANK=", rank);
  const absl::Time deadline = absl::Now() + wait;
  while (true) {
    for (const common::ProcStat& p : JobProcesses(pid_)) {
      if (p.pid == pid_) continue;
      std::string env = ReadFile(absl::StrCat("/proc/", p.pid, "/environ"));
      for (size_t at = 0; at < env.size();) {
        const size_t end = std::min(env.find('\0', at), env.size());
        if (env.compare(at, end - at, want) == 0) return p.pid;
        at = end + 1;
      }
    }
    if (absl::Now() >= deadline || kill(pid_, 0) != 0) return -1;
    absl::SleepFor(absl::Milliseconds(50));
  }
}

bool ServerProcess::Exited(int* code) {
  if (pid_ <= 0) return true;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) != pid_) return false;
  if (code != nullptr) *code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  pid_ = -1;
  return true;
}

std::unique_ptr<inference::GRPCInferenceService::Stub> ServerProcess::NewStub() const {
  grpc::ChannelArguments ch;
  ch.SetMaxReceiveMessageSize(-1);
  ch.SetMaxSendMessageSize(-1);
  return inference::GRPCInferenceService::NewStub(
      grpc::CreateCustomChannel(grpc_address_, grpc::InsecureChannelCredentials(), ch));
}

absl::StatusOr<ServerExit> ServerProcess::Stop(int signal, absl::Duration timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError("not running");
  const absl::Time start = absl::Now();
  kill(pid_, signal);
  return WaitForExit(start, timeout);
}

absl::StatusOr<ServerExit> ServerProcess::StopRanks(int signal, absl::Duration timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError("not running");
  const absl::Time start = absl::Now();
  int signalled = 0;
  for (const common::ProcStat& p : JobProcesses(pid_)) {
    if (p.ppid == pid_ && kill(p.pid, signal) == 0) ++signalled;
  }
  if (signalled == 0) return absl::FailedPreconditionError("mpirun has no rank processes");
  return WaitForExit(start, timeout);
}

absl::StatusOr<ServerExit> ServerProcess::WaitForExit(absl::Time start, absl::Duration timeout) {
  std::optional<int> code = WaitFor(pid_, start + timeout);
  if (!code) {
    std::string left;
    for (const common::ProcStat& p : JobProcesses(pid_)) {
      absl::StrAppend(&left, left.empty() ? "" : ", ", p.pid, " ", p.comm, " (state ",
                      std::string(1, p.state), ", parent ", p.ppid, ")");
    }
    return absl::DeadlineExceededError(absl::StrCat("mpirun still running after ",
                                                    absl::FormatDuration(timeout),
                                                    "; processes of the job: ", left));
  }
  pid_ = -1;
  return ServerExit{*code, absl::Now() - start};
}

}  // namespace epserve::testing
