from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views.i18n import JavaScriptCatalog
from drf_spectacular.views import SpectacularAPIView

from chat import api as chat_api
from chat import views as chat_views
from project import language, views
from project.api_me import MeView
from project.metrics_view import metrics
from tasks import api

handler404 = "project.views.not_found"
handler500 = "project.views.server_error"

urlpatterns = [
    path("", chat_views.chat_page, name="chat"),
    path("healthz", views.healthz, name="healthz"),
    path("metrics", metrics, name="metrics"),
    path("accounts/login/", auth_views.LoginView.as_view(redirect_authenticated_user=True), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("accounts/language/", language.set_language, name="set_language"),
    path("jsi18n/", JavaScriptCatalog.as_view(), name="javascript-catalog"),
    path("api/schema", SpectacularAPIView.as_view(), name="schema"),
    path("api/me", MeView.as_view(), name="me"),
    path("api/features", api.Features.as_view(), name="features"),
    path("api/tasks", api.TaskListCreate.as_view(), name="task-list"),
    path("api/tasks/<str:task_id>", api.TaskDetail.as_view(), name="task-detail"),
    path("api/tasks/<str:task_id>/events", api.TaskEvents.as_view(), name="task-events"),
    path("api/tasks/<str:task_id>/result", api.TaskResult.as_view(), name="task-result"),
    path("api/tasks/<str:task_id>/cancel", api.TaskCancel.as_view(), name="task-cancel"),
    path("api/tasks/<str:task_id>/pause", api.TaskPause.as_view(), name="task-pause"),
    path("api/tasks/<str:task_id>/resume", api.TaskResume.as_view(), name="task-resume"),
    path("api/tasks/<str:task_id>/answer", api.TaskAnswer.as_view(), name="task-answer"),
    path("api/webhooks", include("webhooks.urls")),
    path("api/threads", chat_api.ThreadList.as_view(), name="thread-list"),
    path("api/threads/<str:thread_id>", chat_api.ThreadDetail.as_view(), name="thread-detail"),
    path("api/threads/<str:thread_id>/messages", chat_api.ThreadMessages.as_view(), name="thread-messages"),
    path("api/threads/<str:thread_id>/tasks", chat_api.ThreadTasks.as_view(), name="thread-tasks"),
    path("api/threads/<str:thread_id>/proposals/<str:proposal_id>", chat_api.ProposalDetail.as_view(),
         name="thread-proposal"),
    path("t/<uuid:thread_id>/", chat_views.thread_page, name="thread"),
    path("tasks/<uuid:task_id>/sources/<int:n>/", chat_views.cited_source, name="cited-source"),
]
