// tracon-jobs console: keeps live parts of a page fresh by polling the console's own JSON
// (rendered HTML fragments), and asks before a destructive form is sent. No dependencies.
(function () {
  "use strict";

  var RUN_INTERVAL_MS = 1000;
  var LIST_INTERVAL_MS = 2500;
  var TEXT_INTERVAL_MS = 150;

  function openDetails(root) {
    var open = {};
    root.querySelectorAll("[data-seq] > details").forEach(function (d) {
      open[d.parentElement.getAttribute("data-seq")] = d.open;
    });
    return open;
  }

  function restoreDetails(root, open) {
    root.querySelectorAll("[data-seq] > details").forEach(function (d) {
      var seq = d.parentElement.getAttribute("data-seq");
      if (Object.prototype.hasOwnProperty.call(open, seq)) { d.open = open[seq]; }
    });
  }

  function poll(element, interval, apply) {
    var url = element.getAttribute("data-poll");
    var last = null;
    var timer = null;
    function tick() {
      if (document.hidden) { timer = setTimeout(tick, interval); return; }
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) {
          if (response.status === 401) { window.location.reload(); return null; }
          return response.ok ? response.json() : null;
        })
        .then(function (body) {
          var again = true;
          if (body && body.html !== last) {
            last = body.html;
            again = apply(body) !== false;
          }
          if (again) { timer = setTimeout(tick, interval); }
        })
        .catch(function () { timer = setTimeout(tick, interval * 3); });
    }
    timer = setTimeout(tick, interval);
    return function () { clearTimeout(timer); };
  }

  function liveRun(element) {
    poll(element, RUN_INTERVAL_MS, function (body) {
      var question = document.getElementById("workflow-question");
      if (body.asks && !question) {
        window.location.reload();  // the question and its form are drawn with the page
        return false;
      }
      if (!body.asks && question) { question.remove(); }  // answered elsewhere, or canceled
      var open = openDetails(element);
      element.innerHTML = body.html;
      restoreDetails(element, open);
      bindConfirms(element);
      element.setAttribute("data-status", body.status);
      if (body.terminal) {
        element.removeAttribute("data-poll");
        return false;
      }
      return true;
    });
  }

  // The streaming call's text, polled a few times a second while the run is live: the
  // answer grows on the page as the model writes it; hidden when no call streams.
  function liveText(panel) {
    var body = panel.querySelector(".turn-text-body");
    var url = panel.getAttribute("data-text-poll");
    var stopped = false;
    function tick() {
      if (stopped) { return; }
      if (document.hidden) { setTimeout(tick, TEXT_INTERVAL_MS); return; }
      fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) { return response.ok ? response.json() : null; })
        .then(function (turn) {
          if (turn && turn.text !== null) {
            if (body.textContent !== turn.text) { body.textContent = turn.text; }
            panel.hidden = false;
            panel.setAttribute("data-call", turn.callSeq);
          } else if (turn) {
            panel.hidden = true;
          }
          setTimeout(tick, TEXT_INTERVAL_MS);
        })
        .catch(function () { setTimeout(tick, TEXT_INTERVAL_MS * 5); });
    }
    var run = document.getElementById("run-live");
    if (run) {
      new MutationObserver(function () {
        if (!run.getAttribute("data-poll")) { stopped = true; panel.hidden = true; }
      }).observe(run, { attributes: true });
    }
    tick();
  }

  function liveRows(element) {
    var indicator = document.querySelector("[data-live-indicator]");
    if (indicator) { indicator.hidden = false; }
    poll(element, LIST_INTERVAL_MS, function (body) {
      element.innerHTML = body.html;
      return true;
    });
  }

  function bindConfirms(root) {
    root.querySelectorAll("form[data-confirm]").forEach(function (form) {
      if (form.getAttribute("data-bound")) { return; }
      form.setAttribute("data-bound", "1");
      form.addEventListener("submit", function (event) {
        if (!window.confirm(form.getAttribute("data-confirm"))) { event.preventDefault(); }
      });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    bindConfirms(document);
    var run = document.getElementById("run-live");
    if (run && run.getAttribute("data-poll")) { liveRun(run); }
    var text = document.getElementById("turn-text");
    if (text && text.getAttribute("data-text-poll")) { liveText(text); }
    var rows = document.getElementById("runs-rows");
    if (rows && rows.getAttribute("data-poll")) { liveRows(rows); }
  });
})();
