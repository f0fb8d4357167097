// logging.cpp: console and file sinks for Boost.Log.
#include "core/logging.hpp"

#include <boost/core/null_deleter.hpp>
#include <boost/log/attributes/constant.hpp>
#include <boost/log/core.hpp>
#include <boost/log/expressions.hpp>
#include <boost/log/sinks/sync_frontend.hpp>
#include <boost/log/sinks/text_ostream_backend.hpp>
#include <boost/log/utility/setup/file.hpp>
#include <boost/make_shared.hpp>
#include <boost/shared_ptr.hpp>
#include <fstream>
#include <iostream>

#include "core/error.hpp"
#include "core/paths.hpp"

namespace tessera {

namespace logging = boost::log;
namespace expr = boost::log::expressions;
namespace sinks = boost::log::sinks;

BOOST_LOG_ATTRIBUTE_KEYWORD(severity_kw, "Severity", LogLevel)

namespace {
LogOptions g_opts;

const char* level_prefix(LogLevel l) {
  switch (l) {
    case LogLevel::debug:
      return "debug: ";
    case LogLevel::warning:
      return "warning: ";
    case LogLevel::error:
      return "error: ";
    default:
      return "";
  }
}

void format_record(const logging::record_view& rec, logging::formatting_ostream& strm) {
  auto sev = rec[severity_kw];
  const LogLevel l = sev ? *sev : LogLevel::info;
  if (l == LogLevel::error || l == LogLevel::warning || g_opts.all_ranks)
    strm << "rank " << g_opts.rank << " (" << g_opts.host << "): ";
  strm << level_prefix(l) << rec[expr::smessage];
}
}  // namespace

boost::log::sources::severity_logger_mt<LogLevel>& logger() {
  static boost::log::sources::severity_logger_mt<LogLevel> lg;
  return lg;
}

const LogOptions& log_options() {
  return g_opts;
}

LogLevel log_level_from_name(const std::string& name) {
  if (name == "debug") return LogLevel::debug;
  if (name == "info") return LogLevel::info;
  if (name == "warning") return LogLevel::warning;
  if (name == "error") return LogLevel::error;
  throw ConfigError("--log-level '" + name +
                    "' is not a level (allowed: debug, info, warning, error)");
}

void init_logging(const LogOptions& opts) {
  g_opts = opts;
  auto core = logging::core::get();
  core->remove_all_sinks();

  using text_sink = sinks::synchronous_sink<sinks::text_ostream_backend>;
  auto console = boost::make_shared<text_sink>();
  console->locked_backend()->add_stream(
      boost::shared_ptr<std::ostream>(&std::cout, boost::null_deleter()));
  console->locked_backend()->auto_flush(true);
  console->set_formatter(&format_record);
  const LogLevel min_level = opts.level;
  const bool quiet_rank = !opts.all_ranks && opts.rank != 0;
  console->set_filter([min_level, quiet_rank](const logging::attribute_value_set& attrs) {
    auto sev = attrs[severity_kw];
    const LogLevel l = sev ? *sev : LogLevel::info;
    if (quiet_rank) return l >= LogLevel::warning;  // other ranks speak only when it matters
    return l >= min_level;
  });
  core->add_sink(console);

  if (!opts.file.empty()) {
    create_parent_dirs(opts.file, "--log-file");
    auto stream = boost::make_shared<std::ofstream>(opts.file, std::ios::app);
    if (!*stream)
      throw ConfigError("--log-file '" + opts.file +
                        "' cannot be opened for writing; check its permissions");
    auto file_sink = boost::make_shared<text_sink>();
    file_sink->locked_backend()->add_stream(stream);
    file_sink->locked_backend()->auto_flush(true);
    file_sink->set_formatter(&format_record);
    file_sink->set_filter([min_level](const logging::attribute_value_set& attrs) {
      auto sev = attrs[severity_kw];
      return (sev ? *sev : LogLevel::info) >= min_level;
    });
    core->add_sink(file_sink);
  }
}

}  // namespace tessera
